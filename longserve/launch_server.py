"""`python -m longserve.launch_server --model-path DIR ...`: SGLang's launch spelling of `longserve serve`."""

from __future__ import annotations

import sys

from longserve.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
