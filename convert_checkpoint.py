#!/usr/bin/env python3
"""Convert a PersonaPlex / Moshi checkpoint for the TensorRT-LLM backend.

    python convert_checkpoint.py --model-dir DIR --output-dir build/NAME [--dtype bfloat16]
        [--kv-cache-dtype fp8] [--max-sessions N]

then run the trtllm-build / trtexec commands written to build/NAME/README.md.  The logic
lives in ``engines.export.convert``; ``--help`` explains every option.
"""

import sys

from engines.export.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
