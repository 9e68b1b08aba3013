"""The OpenAI-compatible HTTP server (`moetier serve`): app.create_app(engine, ServerConfig(...))."""
