// The two audio worklets of the page, run on the audio rendering thread.
//
// "pcm-capture": microphone at the context rate -> 24 kHz mono -> whole 80 ms frames
//   (1920 samples), posted to the page as Float32Array with the frame's RMS.
// "pcm-player": 24 kHz model audio -> the context rate, through a small jitter buffer.
//   Playback starts once `targetMs` is buffered; running dry is an underrun (counted) and
//   re-primes the buffer; more than `maxMs` queued drops the oldest audio down to the
//   target, so a hiccup never leaves the conversation permanently delayed.

import { StreamResampler } from "./resampler.js";

const STATS_EVERY_S = 0.1;

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate, frameSamples } = options.processorOptions;
    this.resampler = new StreamResampler(sampleRate, targetRate);
    this.frameSamples = frameSamples;
    this.frame = new Float32Array(frameSamples);
    this.fill = 0;
    this.running = true;
    this.port.onmessage = (event) => {
      if (event.data && event.data.type === "stop") this.running = false;
    };
  }

  process(inputs) {
    const channels = inputs[0];
    if (!this.running) return false;
    if (!channels || channels.length === 0) return true; // no source connected yet
    let mono = channels[0];
    if (channels.length > 1) { // a stereo device: average, the model hears one channel
      mono = new Float32Array(mono.length);
      for (const channel of channels) for (let i = 0; i < mono.length; i++) mono[i] += channel[i] / channels.length;
    }
    const samples = this.resampler.push(mono);
    let offset = 0;
    while (offset < samples.length) {
      const n = Math.min(this.frameSamples - this.fill, samples.length - offset);
      this.frame.set(samples.subarray(offset, offset + n), this.fill);
      this.fill += n;
      offset += n;
      if (this.fill === this.frameSamples) {
        let energy = 0;
        for (let i = 0; i < this.frameSamples; i++) energy += this.frame[i] * this.frame[i];
        const frame = this.frame;
        this.port.postMessage({ type: "frame", frame, rms: Math.sqrt(energy / this.frameSamples) }, [frame.buffer]);
        this.frame = new Float32Array(this.frameSamples);
        this.fill = 0;
      }
    }
    return true; // the node's output stays silent: it only exists to be pulled by the graph
  }
}

class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { sourceRate, targetMs, maxMs } = options.processorOptions;
    this.resampler = new StreamResampler(sourceRate, sampleRate);
    this.ring = new Float32Array(Math.ceil(sampleRate * 10)); // 10 s: far above maxMs
    this.read = 0;
    this.size = 0;
    this.setTargets(targetMs, maxMs);
    this.playing = false;
    this.underruns = 0;
    this.playedSamples = 0;
    this.droppedSamples = 0;
    this.nextStats = 0;
    this.running = true;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  setTargets(targetMs, maxMs) {
    this.target = Math.round(sampleRate * targetMs / 1000);
    this.max = Math.max(this.target, Math.round(sampleRate * maxMs / 1000));
  }

  onMessage(message) {
    if (message.type === "audio") {
      this.enqueue(this.resampler.push(message.samples));
    } else if (message.type === "clear") {
      // Cancel: what the model was saying must stop now, and not resume from the old buffer.
      this.read = 0;
      this.size = 0;
      this.playing = false;
      this.resampler.reset();
    } else if (message.type === "config") {
      this.setTargets(message.targetMs, message.maxMs);
    } else if (message.type === "stop") {
      this.running = false;
    }
  }

  enqueue(samples) {
    const ring = this.ring;
    for (let i = 0; i < samples.length; i++) {
      if (this.size === ring.length) { // cannot happen below maxMs; keep the newest anyway
        this.read = (this.read + 1) % ring.length;
        this.size--;
        this.droppedSamples++;
      }
      ring[(this.read + this.size) % ring.length] = samples[i];
      this.size++;
    }
    if (this.size > this.max) {
      const drop = this.size - this.target;
      this.read = (this.read + drop) % ring.length;
      this.size -= drop;
      this.droppedSamples += drop;
    }
  }

  process(_inputs, outputs) {
    if (!this.running) return false;
    const out = outputs[0][0];
    if (!this.playing && this.size >= this.target && this.size > 0) this.playing = true;
    if (this.playing) {
      const n = Math.min(out.length, this.size);
      for (let i = 0; i < n; i++) out[i] = this.ring[(this.read + i) % this.ring.length];
      this.read = (this.read + n) % this.ring.length;
      this.size -= n;
      this.playedSamples += n;
      if (n < out.length) { // ran dry mid-block: the rest of the block stays silent
        this.underruns++;
        this.playing = false;
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (currentTime >= this.nextStats) {
      this.nextStats = currentTime + STATS_EVERY_S;
      this.port.postMessage({
        type: "stats",
        bufferedMs: 1000 * this.size / sampleRate,
        playedMs: 1000 * this.playedSamples / sampleRate,
        droppedMs: 1000 * this.droppedSamples / sampleRate,
        underruns: this.underruns,
        playing: this.playing,
      });
    }
    return true;
  }
}

registerProcessor("pcm-capture", CaptureProcessor);
registerProcessor("pcm-player", PlayerProcessor);
