"""Command lines: ``python -m engines.tools.NAME`` (offline, voice_builder, bench, bench_plot,
bench_attention, profile_tick)."""
