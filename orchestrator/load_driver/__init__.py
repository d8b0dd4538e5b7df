"""The PersonaPlex realtime duplex load driver, as an installed package (no Quart, hypercorn
or torch: numpy and websockets only), one job per module:

- ``wire``: URLs, the events the driver sends, strict parsing of audio packets;
- ``audio``: WAV in (mono float32 at 24 kHz, tail padding), frames encoded once, WAV out;
- ``probe``: one websocket that records what it receives at a flat cost per event;
- ``pacing``: the 80 ms send grid without catch-up bursts;
- ``packets``: events -> the audio packet log and running audio statistics;
- ``metrics``: pure statistics (percentiles, stream lag, gaps, continuity, stalls, RTF);
- ``acceptance``: the per-session checks;
- ``lifecycle`` / ``load``: the two modes; ``processes``: a load split over worker processes;
- ``report`` / ``plot``: result files, the summary, the timeline PNG;
- ``options``: every setting in one typed place; ``cli``: the command line.

The command line is ``personaplex-load`` (or ``python -m orchestrator.load_driver``); the
reference's ``python -m tests.e2e.online_serving.personaplex_realtime_duplex`` is the same.
"""
