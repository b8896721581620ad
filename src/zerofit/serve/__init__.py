"""``zerofit serve``: an OpenAI-compatible HTTP server over offloaded generation (docs/serve.md).

cache.py keeps one KV-cache row per request; scheduler.py batches the requests in flight into one forward per
step (continuous batching); adapters.py holds several LoRA adapters over one base; schema.py reads the requests;
app.py is the HTTP face (FastAPI on uvicorn, the ``serve`` extra)."""
