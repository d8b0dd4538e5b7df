"""One load run, start to finish: the sessions in this process or spread over worker
processes (``processes``), one result (``load.assemble_result``) written as
``load-result.json``, and the timeline plot (``plot``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from . import wire
from .audio import load_input
from .load import PLOT_NAME, RESULT_NAME, assemble_result, run_sessions_here
from .native_wire import chat_url
from .options import Options
from .report import write_json

log = logging.getLogger(__name__)


def run_load(opts: Options) -> dict[str, Any]:
    """Run the load (in this process, or split over ``opts.process_count()`` worker processes)
    and write ``load-result.json``; returns the result."""
    assert opts.sessions is not None
    output_dir = Path(opts.output_dir)
    result_path = output_dir / RESULT_NAME
    if result_path.exists():
        raise FileExistsError(f"{result_path} exists: refusing to overwrite a previous run's result")
    audio = load_input(Path(opts.input_wav), tail_s=opts.tail_s, expected_sha256=opts.expected_input_sha256,
                       max_frames=opts.load_frames)
    output_dir.mkdir(parents=True, exist_ok=True)
    processes = opts.process_count()
    url = chat_url(opts.url, voice=opts.voice, persona=opts.persona) if opts.protocol == "native" else opts.url
    log.info("load: %d %s sessions x %d frames (%.1f s of audio each) against %s from %d process%s", opts.sessions,
             opts.protocol, audio.frames, audio.frames * wire.FRAME_PERIOD_S, wire.redacted_url(url), processes,
             "" if processes == 1 else "es")
    if processes == 1:
        rows = asyncio.run(run_sessions_here(opts, audio))
    else:
        from .processes import run_sessions_in_processes  # multiprocessing only when asked for

        rows = run_sessions_in_processes(opts, audio, processes)
    result = assemble_result(opts, audio, rows, processes)
    write_json(result_path, result, exclusive=True)
    log.info("load: wrote %s", result_path)
    if opts.plot:
        from .plot import plot_load_result, plot_safely

        plot_safely(lambda: plot_load_result(result, output_dir / PLOT_NAME))
    return result
