"""The embedded stack for demos and tests: nats-server, the four services as processes, and a
scripted OpenAI-compatible LLM backend. See docs/architecture.md.
"""
