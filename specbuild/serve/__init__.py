"""`specbuild serve`: an OpenAI-compatible HTTP server over the runtime's scheduler (pip install 'specbuild[serve]')."""
