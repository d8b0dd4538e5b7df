"""``python -m orchestrator.client``: talk to a personaplex-serve server from the command line.

Streams a WAV file (or, with the optional ``sounddevice`` package, the microphone) over the
Realtime duplex websocket protocol and writes the model's audio and transcript, printing
live latency.  ``cli`` parses and reports, ``conversation`` speaks the protocol, ``sources``
supplies 80 ms frames (file, microphone) and plays audio, ``report`` prints progress.
"""
