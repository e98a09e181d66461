"""The OpenAI-compatible HTTP server: Quart handlers over the engine thread (`AsyncEngine`), run by Hypercorn."""
