// Main-thread side of the page's audio: the AudioContext, the microphone and the two
// worklets (worklets.js), plus PCM16 <-> float and base64 helpers for the wire.

export const MODEL_RATE = 24000; // the model hears and speaks 24 kHz mono
export const FRAME_SAMPLES = 1920; // one 80 ms frame, the model's step

// A failure the user can act on; `message` is shown as is.
export class AudioStartError extends Error {}

// Why getUserMedia failed, in words a user can act on.
function micProblem(error) {
  switch (error && error.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "Microphone access was denied. Allow the microphone for this page (the icon at the left of " +
        "the address bar, or the browser's site settings), then press Connect again.";
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Plug one in (or pick one in the system settings) and press Connect again.";
    case "NotReadableError":
    case "AbortError":
      return "The microphone is in use by another program or could not be opened.";
    default:
      return `The microphone could not be started: ${error && error.message ? error.message : error}`;
  }
}

// Start the microphone and the player.  `onFrame(float32Frame, rms)` gets every 80 ms frame
// at 24 kHz; `onPlayerStats(stats)` the player's buffer level, underruns and played time.
export async function startAudio({ onFrame, onPlayerStats, jitterMs, maxBufferMs }) {
  if (!window.isSecureContext || !navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    throw new AudioStartError("The browser offers the microphone only to secure pages: open this page over " +
      "https:// (or as http://localhost on the server's machine).");
  }
  if (typeof AudioWorkletNode === "undefined") {
    throw new AudioStartError("This browser has no AudioWorklet support; use a current Chrome, Edge, Firefox or Safari.");
  }
  // Created inside the click handler's task, so autoplay rules let it run.
  const ctx = new AudioContext({ latencyHint: "interactive" });
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (error) {
    await ctx.close();
    throw new AudioStartError(micProblem(error));
  }
  try {
    await ctx.audioWorklet.addModule(new URL("worklets.js", import.meta.url));
    const capture = new AudioWorkletNode(ctx, "pcm-capture", {
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { targetRate: MODEL_RATE, frameSamples: FRAME_SAMPLES },
    });
    capture.port.onmessage = (event) => {
      if (event.data.type === "frame") onFrame(event.data.frame, event.data.rms);
    };
    const player = new AudioWorkletNode(ctx, "pcm-player", {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { sourceRate: MODEL_RATE, targetMs: jitterMs, maxMs: maxBufferMs },
    });
    player.port.onmessage = (event) => {
      if (event.data.type === "stats") onPlayerStats(event.data);
    };
    const source = ctx.createMediaStreamSource(stream);
    source.connect(capture);
    capture.connect(ctx.destination); // silent; connected so the graph keeps pulling it
    player.connect(ctx.destination);
    await ctx.resume();
    return new AudioSession(ctx, stream, source, capture, player);
  } catch (error) {
    stream.getTracks().forEach((track) => track.stop());
    await ctx.close();
    throw new AudioStartError(`Audio could not be started: ${error.message || error}`);
  }
}

class AudioSession {
  constructor(ctx, stream, source, capture, player) {
    Object.assign(this, { ctx, stream, source, capture, player });
  }

  get sampleRate() { return this.ctx.sampleRate; }

  play(float32) { this.player.port.postMessage({ type: "audio", samples: float32 }, [float32.buffer]); }

  clearPlayback() { this.player.port.postMessage({ type: "clear" }); }

  setJitter(jitterMs, maxBufferMs) {
    this.player.port.postMessage({ type: "config", targetMs: jitterMs, maxMs: maxBufferMs });
  }

  async close() {
    this.capture.port.postMessage({ type: "stop" });
    this.player.port.postMessage({ type: "stop" });
    this.stream.getTracks().forEach((track) => track.stop());
    this.source.disconnect();
    if (this.ctx.state !== "closed") await this.ctx.close();
  }
}

// Wire helpers --------------------------------------------------------------------------------
export function floatToPcm16Bytes(float32) {
  const bytes = new Uint8Array(float32.length * 2);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < float32.length; i++) {
    const s = Math.max(-1, Math.min(1, float32[i]));
    view.setInt16(2 * i, Math.round(s * 32767), true);
  }
  return bytes;
}

export function pcm16BytesToFloat(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(bytes.byteLength >> 1);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
  return out;
}

export function bytesToBase64(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

export function base64ToBytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}
