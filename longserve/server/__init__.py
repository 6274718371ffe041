"""The HTTP server: OpenAI-compatible routes, SGLang's /generate, admin endpoints, over an AsyncEngine.

FastAPI and uvicorn are imported only here and below (`pip install -e '.[server]'`).
"""

from __future__ import annotations
