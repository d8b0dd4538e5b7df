"""The deployment files hold together: the Kubernetes manifests validate against the API's
schemas (kubernetes-validate, strict: an unknown field fails), and what they say of the server
is what the server does (its probes' paths, its metric, its user, its drain fits the grace
period); the compose files name what exists (docs/DEPLOYMENT.md)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from orchestrator.metrics import Metrics  # noqa: E402
from tests.orch_support import REPO  # noqa: E402

MANIFEST = REPO / "deploy" / "kubernetes" / "personaplex.yaml"
K8S_VERSION = "1.33.0"  # a release the clusters people run today have, with the schemas bundled


def _resources() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def _validate(resource: dict) -> None:
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_every_resource_validates_against_the_kubernetes_schemas():
    resources = _resources()
    assert sorted(r["kind"] for r in resources) == ["Deployment", "HorizontalPodAutoscaler",
                                                    "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]
    for resource in resources:
        _validate(resource)


def test_a_misspelt_field_fails_the_validation():
    """The check can fail: the Deployment with one field misspelt, and with a probe port that
    is neither a number nor a name, is refused."""
    deployment = next(r for r in _resources() if r["kind"] == "Deployment")
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbes"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(misspelt)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = ["nvidia.com/gpu"]
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong_type)


def test_the_manifest_says_what_the_server_does():
    resources = {r["kind"]: r for r in _resources()}
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # Ready means able to serve, not "has a free slot" (a full pod must not be the first one
    # Kubernetes deletes, nor block node drains).
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["timeoutSeconds"] >= 3  # an answer asks each engine, 0.5 s at most
    # The grace period covers the preStop pause, the server's drain and the engines' stop.
    args = container["args"]
    graceful = float(args[args.index("--graceful-timeout") + 1])
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:3] == ["python3", "-m", "orchestrator.drain_wait"]  # a module the image has
    pause = float(hook[hook.index("--deadline-s") + 1])
    assert pod["terminationGracePeriodSeconds"] >= pause + graceful + 10
    # The user is the image's (Dockerfile: useradd --uid).
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", (REPO / "Dockerfile").read_text())[1])
    assert pod["securityContext"]["runAsUser"] == uid
    # The autoscaler's metric is one the server exports.
    metric = resources["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    metrics = Metrics()
    metrics.live_sessions = lambda: 0
    assert f"# TYPE {metric} gauge" in metrics.render()
    # The Service and the PDB select the Deployment's pods.
    labels = resources["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert resources["Service"]["spec"]["selector"] == labels
    assert resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels


@pytest.mark.parametrize("name", ["compose.yaml", "compose.haproxy.yaml"])
def test_the_compose_files_name_what_exists(name: str):
    compose = yaml.safe_load((REPO / "deploy" / name).read_text())
    for service in compose["services"].values():
        build = service.get("build")
        if build:
            assert (REPO / "deploy" / build["context"] / "Dockerfile").is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / "deploy" / source).is_file(), source
            else:
                assert source in compose["volumes"], source
    if name == "compose.haproxy.yaml":
        # Every address haproxy.cfg reads from the environment is given.
        wanted = set(re.findall(r"presetenv (PP_\w+)", (REPO / "deploy" / "haproxy.cfg").read_text()))
        assert wanted <= set(compose["services"]["balancer"]["environment"])
        balancer_ip = compose["services"]["balancer"]["networks"]["personaplex"]["ipv4_address"]
        for n, replica in enumerate(("replica1", "replica2"), start=1):
            service = compose["services"][replica]
            assert service["environment"]["PERSONAPLEX_TRUSTED_PROXIES"] == balancer_ip
            # haproxy.cfg resolves its servers once: the replicas' addresses are fixed, and its.
            address = service["networks"]["personaplex"]["ipv4_address"]
            assert compose["services"]["balancer"]["environment"][f"PP_REPLICA{n}"] == f"{address}:8000"
