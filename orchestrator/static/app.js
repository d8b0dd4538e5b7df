// The talk page: pickers, connect / cancel / disconnect, live stats and the transcript.
// Audio lives in audio.js (+ worklets.js), the protocol in realtime.js.

import { AudioStartError, startAudio } from "./audio.js";
import { RealtimeClient, realtimeUrl } from "./realtime.js";

const MAX_BUFFER_MS = 1000; // the player drops audio queued beyond this (see worklets.js)
const RTT_SMOOTHING = 0.1; // weight of the newest sample in the running average

// What a user can do about a server error, by code; the server's own message follows.
const ERROR_HINTS = {
  resource_exhausted: "The server is full: every conversation slot is in use. Try again in a minute.",
  engine_unavailable: "The model is not ready (still loading, or it failed to load). Try again shortly.",
  invalid_voice: "The server cannot use this voice; pick another one.",
  prefill_unavailable: "The server could not prepare this voice or persona; pick another one.",
  invalid_api_key: "The server refused the API key; check it under \"API key\".",
  config_timeout: "The server timed out waiting for the session settings.",
  output_backpressure: "The connection could not keep up with the model's audio.",
  input_backpressure: "The microphone audio arrived faster than the model could take it.",
};

const $ = (id) => document.getElementById(id);

// Everything the stats panel shows; also read by the end-to-end test (window.personaplexStats).
const stats = {
  rttMs: null, rttAvgMs: null, bufferMs: null, underruns: 0, playedMs: 0, droppedMs: 0,
  deltas: 0, samplesReceived: 0, framesSent: 0, framesDropped: 0, micRms: null, tickMs: null, errors: 0,
};
window.personaplexStats = stats;

let audio = null; // AudioSession while connected
let client = null; // RealtimeClient while connected
let leaving = false; // the user asked to disconnect: a close is expected
let lastErrorCode = null;
let paragraph = null; // the transcript paragraph the model is speaking into

// Pickers ----------------------------------------------------------------------------------
async function loadVoices() {
  let body;
  try {
    const response = await fetch("/v1/voices", { cache: "no-store" });
    body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
  } catch (error) {
    $("model-info").textContent = `Waiting for the server (${error.message})…`;
    setTimeout(loadVoices, 2000);
    return;
  }
  const voice = $("voice");
  voice.replaceChildren(...body.data.map((v) => new Option(v.name, v.id, v.default, v.default)));
  const preset = $("persona-preset");
  const presets = body.personas.map((text, i) => new Option(text.length > 70 ? `${text.slice(0, 67)}…` : text, String(i)));
  preset.replaceChildren(...presets, new Option("Custom (edit below)", "custom"));
  preset.onchange = () => {
    if (preset.value !== "custom") $("persona").value = body.personas[Number(preset.value)];
  };
  $("persona").value = body.default_persona;
  $("persona").oninput = () => { preset.value = "custom"; };
  voice.disabled = preset.disabled = false;
  $("connect").disabled = false;
  const info = $("model-info");
  info.textContent = `Model ${body.model} · ${body.data.length} voices · up to ${body.max_sessions} conversations. `;
  if (body.demo) {
    const warn = document.createElement("span");
    warn.className = "warning";
    warn.textContent = "This is the untrained demo model: its speech is noise.";
    info.append(warn);
  }
}

// Connect / cancel / disconnect ------------------------------------------------------------
function setStatus(text, state) {
  const status = $("status");
  status.textContent = text;
  status.dataset.state = state;
}

function showNotice(text) {
  const notice = $("notice");
  notice.textContent = text;
  notice.hidden = !text;
}

function setButtons(phase) { // "idle" | "starting" | "live" | "closing"
  $("connect").disabled = phase !== "idle";
  $("voice").disabled = $("persona-preset").disabled = $("persona").disabled = $("api-key").disabled =
    phase !== "idle";
  $("cancel").disabled = phase !== "live";
  $("disconnect").disabled = phase === "idle";
}

async function connect() {
  setButtons("starting");
  showNotice("");
  leaving = false;
  lastErrorCode = null;
  Object.assign(stats, { rttMs: null, rttAvgMs: null, underruns: 0, playedMs: 0, deltas: 0, samplesReceived: 0,
    framesSent: 0, framesDropped: 0, errors: 0 });
  setStatus("Starting the microphone…", "starting");
  const jitterMs = Number($("jitter").value);
  try {
    audio = await startAudio({ onFrame, onPlayerStats, jitterMs, maxBufferMs: MAX_BUFFER_MS });
  } catch (error) {
    showNotice(error instanceof AudioStartError ? error.message : `Audio failed: ${error}`);
    setStatus("Not connected.", "idle");
    setButtons("idle");
    return;
  }
  setStatus("Connecting…", "starting");
  client = new RealtimeClient(realtimeUrl(window.location),
    { voice: $("voice").value, persona: $("persona").value, apiKey: $("api-key").value.trim() },
    { onOpen, onAudio, onText, onResponseDone, onError, onClosed });
}

function onOpen(session) {
  setStatus(`Live: talk to the model (voice ${session.voice}, session ${session.id}).`, "live");
  setButtons("live");
  newParagraph();
}

function cancelReply() {
  if (!client) return;
  client.cancel();
  audio.clearPlayback();
  marker("reply cancelled; the model starts afresh");
  newParagraph();
}

function disconnect() {
  leaving = true;
  setButtons("closing");
  setStatus("Closing…", "closing");
  if (client) client.close();
  else teardown();
}

function onClosed(code, reason, closedEvent) {
  teardown();
  if (code === 1013 || reason === "resource_exhausted") {
    if (lastErrorCode !== "resource_exhausted") showNotice(ERROR_HINTS.resource_exhausted);
  } else if (!leaving && !closedEvent && lastErrorCode === null) {
    showNotice(code === 1006
      ? "Could not reach the conversation server, or it refused the connection (a server that requires an " +
        "API key refuses a missing or wrong one: enter it under \"API key\")."
      : `The server closed the connection (${code}${reason ? `: ${reason}` : ""}).`);
  }
  const why = closedEvent ? closedEvent.reason : reason || `code ${code}`;
  setStatus(`Disconnected (${why}).`, "idle");
  setButtons("idle");
}

function teardown() {
  client = null;
  if (audio) {
    audio.close();
    audio = null;
  }
  stats.bufferMs = null;
}

// Audio and text -------------------------------------------------------------------------
function onFrame(frame, rms) {
  stats.micRms = rms;
  if (!client) return;
  client.sendFrame(frame);
  stats.framesSent = client.framesSent;
  stats.framesDropped = client.framesDropped;
}

function onPlayerStats(player) {
  Object.assign(stats, { bufferMs: player.bufferedMs, underruns: player.underruns, playedMs: player.playedMs,
    droppedMs: player.droppedMs });
}

function onAudio(samples, event, rttMs) {
  stats.deltas++;
  stats.samplesReceived += samples.length;
  if (audio) audio.play(samples);
  const timing = event.metadata && event.metadata.timing;
  if (timing && typeof timing.tick_ms === "number") stats.tickMs = timing.tick_ms;
  if (rttMs !== null) {
    stats.rttMs = rttMs;
    stats.rttAvgMs = stats.rttAvgMs === null ? rttMs : stats.rttAvgMs + RTT_SMOOTHING * (rttMs - stats.rttAvgMs);
  }
}

function onText(text) {
  if (!paragraph) newParagraph();
  paragraph.append(text);
  const box = $("transcript");
  box.scrollTop = box.scrollHeight;
}

function onResponseDone(event) {
  const response = event.response || {};
  if (response.status === "failed") marker("the model's reply failed; it starts afresh");
}

function onError(error) {
  stats.errors++;
  lastErrorCode = error.code;
  const hint = ERROR_HINTS[error.code];
  showNotice(`${hint ? `${hint} ` : ""}(${error.code}: ${error.message})`);
}

function newParagraph() {
  paragraph = document.createElement("p");
  $("transcript").append(paragraph);
}

function marker(text) {
  const note = document.createElement("p");
  note.className = "marker";
  note.textContent = `— ${text} —`;
  $("transcript").append(note);
}

// Stats panel ----------------------------------------------------------------------------
function show(id, value, text) {
  const cell = $(id);
  cell.dataset.value = value === null ? "" : String(value);
  cell.textContent = value === null ? "—" : text;
}

function renderStats() {
  const ms = (v) => `${Math.round(v)} ms`;
  show("stat-rtt", stats.rttMs, stats.rttMs === null ? "" : `${ms(stats.rttMs)} (avg ${ms(stats.rttAvgMs)})`);
  show("stat-buffer", stats.bufferMs, stats.bufferMs === null ? "" : ms(stats.bufferMs));
  show("stat-underruns", stats.underruns, String(stats.underruns));
  show("stat-played", stats.playedMs, `${(stats.playedMs / 1000).toFixed(1)} s`
    + (stats.droppedMs > 0 ? ` (${(stats.droppedMs / 1000).toFixed(1)} s dropped)` : ""));
  show("stat-deltas", stats.deltas, String(stats.deltas));
  show("stat-sent", stats.framesSent, String(stats.framesSent));
  show("stat-dropped", stats.framesDropped, String(stats.framesDropped));
  const db = stats.micRms === null ? null : 20 * Math.log10(Math.max(stats.micRms, 1e-6));
  show("stat-mic", db, db === null ? "" : `${db.toFixed(0)} dBFS`);
  show("stat-tick", stats.tickMs, stats.tickMs === null ? "" : `${stats.tickMs.toFixed(1)} ms per 80 ms frame`);
}

$("connect").onclick = connect;
$("cancel").onclick = cancelReply;
$("disconnect").onclick = disconnect;
$("jitter").onchange = () => { if (audio) audio.setJitter(Number($("jitter").value), MAX_BUFFER_MS); };
setInterval(renderStats, 250);
loadVoices();
