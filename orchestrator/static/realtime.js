// The page's client of the Realtime duplex websocket protocol (docs/ORCHESTRATOR.md).
// It knows event names and payloads and nothing about the UI: the page passes handlers.
//
//   session.update -> session.created / session.updated -> appends in, deltas out
//   response.cancel -> terminal sequence, epoch + 1 (a fresh model context)
//   session.close -> session.closed -> websocket close 1000

import { base64ToBytes, bytesToBase64, floatToPcm16Bytes, pcm16BytesToFloat } from "./audio.js";

export const FRAME_MS = 80;
// Above this many unsent bytes the network is not keeping up: later frames are dropped
// (and counted) instead of queueing seconds of stale speech.
const MAX_BUFFERED_BYTES = 512 * 1024;

// The websocket URL of this page's server: wss:// behind TLS, ws:// otherwise.
export function realtimeUrl(location) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/realtime?duplex=1`;
}

// Browsers cannot set an Authorization header on a websocket: an API key travels as the
// subprotocol "openai-insecure-api-key.<key>" (the OpenAI Realtime convention), offered
// beside "realtime", which the server then selects.  Without a key none is offered.
export function keyProtocols(apiKey) {
  return apiKey ? ["realtime", `openai-insecure-api-key.${apiKey}`] : [];
}

// Handlers: onOpen(session), onAudio(float32, event), onText(text, event),
// onResponseDone(event), onError(error), onClosed(code, reason, closedEvent).
export class RealtimeClient {
  constructor(url, { voice, persona, apiKey }, handlers) {
    this.handlers = handlers;
    this.session = null;
    this.sent = new Map(); // frame index in this epoch -> send time (ms), for the round trip
    this.startEpoch(0); // the epoch whose audio we play; older deltas are stale
    this.framesSent = 0;
    this.framesDropped = 0;
    this.closedEvent = null;
    this.ws = new WebSocket(url, keyProtocols(apiKey));
    this.ws.onopen = () => this.send({
      type: "session.update",
      session: {
        voice,
        instructions: persona,
        modalities: ["audio", "text"],
        // PCM16 halves the upstream bandwidth of float32; at 24 kHz the server only rescales it.
        input_audio_format: "pcm16",
        sample_rate_hz: 24000,
        output_audio_format: "pcm16",
        turn_detection: null,
      },
    });
    this.ws.onmessage = (message) => this.onMessage(message.data);
    this.ws.onclose = (event) => handlers.onClosed(event.code, event.reason, this.closedEvent);
  }

  get isOpen() { return this.session !== null && this.ws.readyState === WebSocket.OPEN; }

  send(event) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  // One 80 ms frame of 24 kHz float32 microphone audio.
  sendFrame(float32) {
    if (!this.isOpen) return;
    if (this.ws.bufferedAmount > MAX_BUFFERED_BYTES) {
      this.framesDropped++;
      return;
    }
    if (this.roundTripKnown) this.sent.set(this.epochFrames, performance.now());
    this.epochFrames++;
    this.framesSent++;
    this.send({ type: "input_audio_buffer.append", audio: bytesToBase64(floatToPcm16Bytes(float32)) });
  }

  cancel() {
    if (!this.isOpen) return;
    this.send({ type: "response.cancel" });
    // Frames sent from now on belong to the next epoch (the socket is ordered).
    this.startEpoch(this.epoch + 1);
  }

  startEpoch(epoch) {
    this.epoch = epoch;
    this.epochFrames = 0;
    this.roundTripKnown = true;
    this.sent.clear();
  }

  close() {
    if (this.isOpen) this.send({ type: "session.close" });
    else this.ws.close(1000);
    // The server answers session.closed, then closes; don't wait forever for a dead peer.
    setTimeout(() => { if (this.ws.readyState !== WebSocket.CLOSED) this.ws.close(1000); }, 3000);
  }

  onMessage(data) {
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      return; // the protocol only sends JSON objects; ignore anything else
    }
    const h = this.handlers;
    switch (event.type) {
      case "session.created":
        this.session = event.session;
        this.startEpoch(event.session.epoch || 0);
        h.onOpen(event.session);
        break;
      case "response.output_audio.delta":
      case "response.audio.delta": {
        const meta = event.metadata || {};
        if (typeof meta.epoch === "number" && meta.epoch < this.epoch) return; // cancelled: stale
        if (typeof meta.epoch === "number" && meta.epoch > this.epoch) {
          // The server restarted the context on its own (after an engine error): our frame
          // numbering no longer matches, so the round trip is unknown until the next epoch.
          this.startEpoch(meta.epoch);
          this.roundTripKnown = false;
        }
        h.onAudio(pcm16BytesToFloat(base64ToBytes(event.delta)), event, this.roundTrip(meta));
        break;
      }
      case "response.output_audio_transcript.delta":
      case "response.text.delta":
      case "response.output_text.delta":
        if (event.delta) h.onText(event.delta, event);
        break;
      case "response.done":
        h.onResponseDone(event);
        break;
      case "error":
        h.onError(errorOf(event));
        break;
      case "session.closed":
        this.closedEvent = event;
        break;
      default:
        break;
    }
  }

  // Milliseconds from sending the last input frame a delta answers to receiving the delta.
  // Lockstep: output frame k of an epoch is the model's step on input frame k.
  roundTrip(meta) {
    if (!this.roundTripKnown || typeof meta.audio_duration_ms !== "number") return null;
    const last = Math.round(meta.audio_duration_ms / FRAME_MS) - 1;
    const sentAt = this.sent.get(last);
    for (const index of this.sent.keys()) { // forget answered frames
      if (index > last) break;
      this.sent.delete(index);
    }
    return sentAt === undefined ? null : performance.now() - sentAt;
  }
}

// The error object of an `error` event (current envelope, or the legacy flat one).
export function errorOf(event) {
  if (event.error && typeof event.error === "object") return event.error;
  return { code: event.code || "unknown", message: String(event.error || "error"), type: "invalid_request_error" };
}
