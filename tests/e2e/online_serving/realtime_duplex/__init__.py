"""The PersonaPlex realtime duplex driver, one job per module:

- ``wire``: URLs, the events the driver sends, strict parsing of audio packets;
- ``audio``: WAV in (mono float32 at 24 kHz, tail padding), frames, WAV out;
- ``probe``: one websocket that records every event with its arrival time;
- ``pacing``: the 80 ms send grid without catch-up bursts;
- ``packets``: recorded events -> the audio packet log;
- ``metrics``: pure statistics (percentiles, continuity, playout stalls, stream RTF);
- ``acceptance``: the per-session checks;
- ``lifecycle`` / ``load``: the two modes;
- ``report`` / ``plot``: result files, the summary, the timeline PNG;
- ``options``: every setting in one typed place.

The command line is ``python -m tests.e2e.online_serving.personaplex_realtime_duplex``.
"""
