"""Cross-references in the tree resolve: a cited docs section exists, a cited raw file exists,
and the README needs nothing outside the repository.

What is scanned: every file ``git ls-files`` lists, read as UTF-8 text (binary files are
skipped), except the raw measurement files under ``docs/results/`` (program output, quoted as
it came) and this file (its examples below are not references).  Section references are read
in each file joined into one line: every line's leading whitespace and comment markers
(``#``, ``//``, ``*``, ``>``) stripped, the lines joined with a space, so that a reference
wrapped across the lines of a comment or a docstring is read whole; paths and links are read
line by line.  A problem is reported with its file and the line where the reference starts.

1. **Section references.**  A docs file name followed by one or more quoted titles::

       docs/PERFORMANCE.md, "Joining prefill"        (docs/PERFORMANCE.md, "Joining prefill")
       docs/RELIABILITY.md ("Faults")                `docs/ORCHESTRATOR.md`, "Starting" and "Processes"
       PERFORMANCE.md, "Joining prefill"             [ORCHESTRATOR.md](ORCHESTRATOR.md), "Processes"

   A name with ``docs/`` before it must be a file under ``docs/``; a bare name (``X.md``, not
   part of a longer path) counts only when ``docs/X.md`` exists (``build/README.md`` and the
   like are other files).  Each quoted title must name a heading of that file: a line of one
   to six ``#`` outside fenced code blocks.  **Matching rule**: after collapsing runs of
   whitespace, a title matches a heading that equals it, or that starts with it where the
   next character of the heading is not a letter or a digit: a section may be cited by its
   first words ("The native route at 128 sessions" for "The native route at 128 sessions
   (issue 17, 2026-12-03)"), but "Start" does not match "Starting".  Case counts.  Bold
   labels (``**Restarts**``) are not headings.

   Inside a docs file, a section of the same file cited without a file name, in the forms
   ``section "Joining prefill"``, ``sections "A" and "B"``, ``see "Starting"`` and ``"Processes"
   below`` (or ``above``), must name a heading of that file by the same rule.

2. **Anchors.**  A markdown link to a docs file with ``#anchor`` must name a heading's
   GitHub anchor (lower case, punctuation other than ``-`` and ``_`` dropped, spaces as ``-``);
   a markdown link to a ``.md`` file must reach an existing file.

3. **Docs files.**  Every ``docs/X.md`` named anywhere exists.

4. **Raw files.**  Every ``docs/results/...`` path named anywhere exists.  Shell forms
   expand: ``{json,log}`` (also ``{,-gil}``) gives one path per alternative, and ``*`` or
   ``?`` must match at least one file.  In the docs and the README, a file name in backquotes
   that starts with a date (`2026-12-03-...`) names a file in ``docs/results/``, and one that
   starts with an ellipsis (`...-profile-b1-final.txt`, the docs' short form) must match the
   end of one.

5. **The README** mentions no path outside the repository (``../``): a clone has nothing
   there.

Runs in well under a second: the standard library and one ``git ls-files``.
"""

from __future__ import annotations

import bisect
import functools
import glob
import itertools
import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = DOCS / "results"
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()

# A quoted title: straight or typographic double quotes, no quote inside, at most 200
# characters; then one or more of them ("A", "A" and "B", "A", "B" or "C").
_TITLE = r'(?:"[^"\n]{1,200}"|\u201c[^\u201d\n]{1,200}\u201d)'
_TITLES = rf"(?P<titles>{_TITLE}(?:\s*(?:,|and|or|, and|, or)\s*{_TITLE})*)"
TITLE = re.compile(_TITLE)
SECTION_REF = re.compile(
    r"(?<![\w./-])(?P<path>(?:docs/)?(?P<name>[A-Za-z0-9_-]+\.md))`?"  # docs/X.md or X.md, maybe `quoted`
    r"(?:\]\([^)\s]*\))?"  # [X.md](X.md): the link's target is read by MD_LINK
    r"\s*(?:,|\()\s*"  # then ", " or " ("
    + _TITLES
)
# Within a docs file: section "A", sections "A" and "B", see "A", "A" below, "A" and "B" above.
SAME_FILE_REF = re.compile(
    rf"\b(?:[Ss]ections?|[Ss]ee)\s+{_TITLES}"
    rf"|{_TITLES.replace('titles', 'titles2')}\s+(?:above|below)\b"
)
DOCS_NAME = re.compile(r"(?<![\w./-])docs/(?P<name>[A-Za-z0-9_-]+\.md)\b")
MD_LINK = re.compile(r"\]\((?P<target>[^)\s#]+\.md)(?:#(?P<anchor>[^)\s]+))?\)")
# A docs/results path: word characters, . - + * ? and brace groups without spaces ({a,b}).
RESULTS_PATH = re.compile(r"docs/results/(?P<rest>(?:[\w.*?+-]|\{[^{}\s]*\})*)")
# In docs: `2026-12-01-...` (a raw file by name) and `...-suffix` / `\u2026-suffix` (its end).
DATED_NAME = re.compile(r"`(?P<name>20\d\d-\d\d-\d\d-(?:[\w.*?+-]|\{[^{}\s`]*\})+)`")
ELLIPSIS_NAME = re.compile(r"`(?:\u2026|\.\.\.)(?P<tail>-(?:[\w.*?+-]|\{[^{}\s`]*\})+)`")
COMMENT_MARKER = re.compile(r"^\s*(?:#+|//+|\*+(?=\s)|>+)?\s*")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"git ls-files failed here ({error}); the docs references need a git checkout")
    return [name for name in out.decode().split("\0") if name]


def scanned_files() -> dict[str, str]:
    """Tracked text files, by path relative to the repository, except raw results and this file."""
    texts = {}
    for name in tracked_files():
        if name.startswith("docs/results/") or name == THIS_FILE:
            continue
        path = REPO / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def joined(text: str) -> tuple[str, list[int]]:
    """The text as one line (comment markers and indentation stripped), with the offset at
    which each original line starts in it."""
    parts, starts, offset = [], [], 0
    for line in text.splitlines():
        line = COMMENT_MARKER.sub("", line, count=1).rstrip()
        starts.append(offset)
        parts.append(line)
        offset += len(line) + 1
    return " ".join(parts), starts


def line_of(starts: list[int], offset: int) -> int:
    return bisect.bisect_right(starts, offset)


def normalise(title: str) -> str:
    return " ".join(unicodedata.normalize("NFC", title).split())


@functools.cache
def headings(doc: str) -> tuple[str, ...]:
    """The headings of docs/DOC (``#`` lines outside fenced code blocks)."""
    found, fenced = [], False
    for line in (DOCS / doc).read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            found.append(normalise(match["title"]))
    return tuple(found)


def title_matches(title: str, heading: str) -> bool:
    """The module's rule: equal, or the heading starts with the title at a word boundary."""
    title, heading = normalise(title), normalise(heading)
    if heading == title:
        return True
    return heading.startswith(title) and not heading[len(title)].isalnum()


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def expand_braces(pattern: str) -> list[str]:
    """Shell brace expansion, one level per group: a{b,c}d{e,} -> abde, abd, acde, acd."""
    pieces = re.split(r"(\{[^{}]*\})", pattern)
    options = [piece[1:-1].split(",") if piece.startswith("{") and piece.endswith("}") else [piece]
               for piece in pieces]
    return ["".join(choice) for choice in itertools.product(*options)]


def missing_results(rest: str, root: Path = RESULTS, suffix_only: bool = False) -> list[str]:
    """The expansions of a results path (relative to docs/results/) that name no file."""
    rest = rest.rstrip(".,;:")
    missing = []
    for candidate in expand_braces(rest) if rest else [""]:
        pattern = ("*" + candidate) if suffix_only else candidate
        if any(char in pattern for char in "*?["):
            if not glob.glob(glob.escape(str(root)) + "/" + pattern):
                missing.append(candidate)
        elif not (root / pattern).exists():
            missing.append(candidate)
    return missing


def section_problems(name: str, text: str) -> list[str]:
    problems = []
    flat, starts = joined(text)
    seen = set()
    for match in SECTION_REF.finditer(flat):
        path, doc = match["path"], match["name"]
        where = f"{name}:{line_of(starts, match.start())}"
        if not (DOCS / doc).is_file():
            if path.startswith("docs/"):
                problems.append(f"{where}: {path} does not exist")
            continue  # a bare X.md that is not a docs file: another file's name
        for title_match in TITLE.finditer(match["titles"]):
            title = title_match.group()[1:-1]
            key = (where, doc, title)
            if key in seen:
                continue
            seen.add(key)
            if not any(title_matches(title, heading) for heading in headings(doc)):
                problems.append(f'{where}: docs/{doc}, "{title}": no such heading in docs/{doc}')
    if not (name.startswith("docs/") and name.count("/") == 1):
        return problems
    doc = name.removeprefix("docs/")
    spans = [match.span() for match in SECTION_REF.finditer(flat)]
    for match in SAME_FILE_REF.finditer(flat):
        if any(start <= match.start() < end or start < match.end() <= end for start, end in spans):
            continue  # the titles of a reference to a named file, read above
        where = f"{name}:{line_of(starts, match.start())}"
        for title_match in TITLE.finditer(match["titles"] or match["titles2"]):
            title = title_match.group()[1:-1]
            if not any(title_matches(title, heading) for heading in headings(doc)):
                problems.append(f'{where}: "{title}" (this file): no such heading in {name}')
    return problems


def link_problems(name: str, text: str) -> list[str]:
    problems = []
    base = (REPO / name).parent
    for number, line in enumerate(text.splitlines(), 1):
        for match in MD_LINK.finditer(line):
            target = match["target"]
            if "://" in target:
                continue
            resolved = (base / target).resolve()
            if not resolved.is_file():
                problems.append(f"{name}:{number}: link to {target}: no such file")
                continue
            anchor = match["anchor"]
            if anchor and resolved.parent == DOCS:
                anchors = {github_anchor(heading) for heading in headings(resolved.name)}
                if anchor not in anchors:
                    problems.append(f"{name}:{number}: link to {target}#{anchor}: no heading has that anchor")
    return problems


def path_problems(name: str, text: str) -> list[str]:
    problems = []
    in_docs = name.startswith("docs/") or name == "README.md"
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{name}:{number}"
        for match in DOCS_NAME.finditer(line):
            if not (DOCS / match["name"]).is_file():
                problems.append(f"{where}: docs/{match['name']} does not exist")
        for match in RESULTS_PATH.finditer(line):
            for candidate in missing_results(match["rest"]):
                problems.append(f"{where}: docs/results/{candidate} does not exist")
        if not in_docs:
            continue
        for match in DATED_NAME.finditer(line):
            for candidate in missing_results(match["name"]):
                problems.append(f"{where}: `{candidate}` names no file in docs/results/")
        for match in ELLIPSIS_NAME.finditer(line):
            for candidate in missing_results(match["tail"], suffix_only=True):
                problems.append(f"{where}: `...{candidate}` matches the end of no file in docs/results/")
    return problems


def test_docs_references_resolve():
    texts = scanned_files()
    assert "README.md" in texts and "docs/PERFORMANCE.md" in texts, sorted(texts)[:20]
    problems = []
    for name, text in sorted(texts.items()):
        problems += section_problems(name, text)
        problems += link_problems(name, text)
        problems += path_problems(name, text)
    report = "\n".join(problems)
    if problems:
        print(f"{len(problems)} dangling reference(s):\n{report}")
    assert not problems, f"{len(problems)} dangling reference(s):\n{report}"


def test_readme_needs_nothing_outside_the_repository():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    outside = [f"README.md:{number}: {line.strip()}" for number, line in enumerate(readme.splitlines(), 1)
               if "../" in line]
    assert not outside, "the README points outside the repository:\n" + "\n".join(outside)


def test_the_scanner_reads_the_forms_the_tree_uses():
    """The forms of the module docstring, built here, each found; a wrapped comment joined."""
    doc, title = "PERFORMANCE.md", "Joining prefill"
    quoted = '"' + title + '"'
    forms = [f"docs/{doc}, {quoted}", f"(docs/{doc}, {quoted})", f"docs/{doc} ({quoted})",
             f"`docs/{doc}`, {quoted}", f"see {doc}, {quoted}", f"[{doc}]({doc}), {quoted}",
             f"# a comment that wraps (docs/{doc},\n# {quoted}) here",
             f'    """A docstring (docs/{doc},\n    {quoted})."""']
    for form in forms:
        flat, _ = joined(form)
        found = list(SECTION_REF.finditer(flat))
        assert len(found) == 1 and found[0]["name"] == doc, form
        assert TITLE.findall(found[0]["titles"]) == [quoted], form
    flat, _ = joined('`docs/ORCHESTRATOR.md`, "Starting" and "Processes"')
    assert TITLE.findall(next(SECTION_REF.finditer(flat))["titles"]) == ['"Starting"', '"Processes"']
    assert not list(SECTION_REF.finditer('build/README.md, "x"'))  # part of a longer path
    assert not list(SECTION_REF.finditer("(docs/PERFORMANCE.md, why)"))  # no title
    same = [m["titles"] or m["titles2"] for m in SAME_FILE_REF.finditer(
        'in section "A" above; see "B"; "C" and "D" below')]
    assert same == ['"A"', '"B"', '"C" and "D"'], same
    assert DATED_NAME.search("`2026-12-01-h200-bench-final.{json,log}`")["name"] == "2026-12-01-h200-bench-final.{json,log}"
    assert ELLIPSIS_NAME.search("(`\u2026-profile-b1-final.txt`)")["tail"] == "-profile-b1-final.txt"
    assert title_matches("The native route at 128 sessions", "The native route at 128 sessions (issue 17, 2026-12-03)")
    assert title_matches("Start-up on the H200", "Start-up on the H200 (issue 16, 2026-12-02)")
    assert not title_matches("Start", "Starting")
    assert expand_braces("a-{x,y}-{.log,-load.log}") == ["a-x-.log", "a-x--load.log", "a-y-.log", "a-y--load.log"]
    assert expand_braces("n128{,-gil}.log") == ["n128.log", "n128-gil.log"]
    assert github_anchor("Settings (`orchestrator/settings.py`)") == "settings-orchestratorsettingspy"
