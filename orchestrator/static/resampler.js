// A streaming band-limited resampler (windowed sinc), used by both audio worklets: the
// microphone (context rate -> 24 kHz) and the player (24 kHz -> context rate).
//
// Why not linear interpolation: downsampling 48 kHz speech to 24 kHz without a low-pass
// folds everything above 12 kHz back into the band the model listens to.  The kernel is a
// Blackman-windowed sinc with its cutoff at 90 % of the lower Nyquist, tabulated once and
// read with linear interpolation, so a sample costs 2 * halfTaps / ratio multiply-adds.

const TABLE_STEPS = 512; // kernel samples per input sample

export class StreamResampler {
  constructor(inRate, outRate, halfTaps = 16) {
    if (!(inRate > 0 && outRate > 0)) throw new RangeError(`bad rates ${inRate} -> ${outRate}`);
    this.step = inRate / outRate; // input samples per output sample
    const ratio = Math.min(1, outRate / inRate);
    const cutoff = 0.9 * ratio; // in units of the input Nyquist
    this.halfWidth = halfTaps / ratio; // kernel half-width in input samples
    const n = Math.ceil(this.halfWidth * TABLE_STEPS) + 2;
    this.table = new Float32Array(n);
    for (let i = 0; i < n; i++) {
      const x = i / TABLE_STEPS;
      if (x >= this.halfWidth) break;
      const arg = Math.PI * cutoff * x;
      const sinc = x === 0 ? 1 : Math.sin(arg) / arg;
      const w = Math.PI * x / this.halfWidth;
      const blackman = 0.42 + 0.5 * Math.cos(w) + 0.08 * Math.cos(2 * w);
      this.table[i] = cutoff * sinc * blackman;
    }
    this.reset();
  }

  // Forget all history (after a cancel, the old audio must not bleed into the new).
  reset() {
    const history = Math.ceil(this.halfWidth);
    this.buf = new Float32Array(Math.max(4096, history * 4));
    this.len = history; // zeros: the first output is centred on the first input sample
    this.t = history; // position of the next output sample, in input samples into buf
  }

  kernel(x) {
    const a = Math.abs(x) * TABLE_STEPS;
    const i = a | 0;
    const frac = a - i;
    return this.table[i] * (1 - frac) + this.table[i + 1] * frac;
  }

  // Feed input samples (Float32Array); returns the output samples now complete.
  push(input) {
    if (this.len + input.length > this.buf.length) {
      const grown = new Float32Array(2 * (this.len + input.length));
      grown.set(this.buf.subarray(0, this.len));
      this.buf = grown;
    }
    this.buf.set(input, this.len);
    this.len += input.length;
    const w = this.halfWidth;
    const last = this.len - 1 - w; // an output at t needs input up to t + w
    const count = this.t <= last ? Math.floor((last - this.t) / this.step) + 1 : 0;
    const out = new Float32Array(count);
    const buf = this.buf;
    for (let k = 0; k < count; k++) {
      const t = this.t;
      const hi = Math.floor(t + w);
      let acc = 0;
      for (let i = Math.ceil(t - w); i <= hi; i++) acc += buf[i] * this.kernel(i - t);
      out[k] = acc;
      this.t += this.step;
    }
    const drop = Math.floor(this.t - w); // samples no future output can reach
    if (drop > 0) {
      buf.copyWithin(0, drop, this.len);
      this.len -= drop;
      this.t -= drop;
    }
    return out;
  }
}
