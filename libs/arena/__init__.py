"""Arena's client: the Python SDK, the ``arena`` CLI, the trainer's trajectory stream and exports.

See README.md and docs/architecture.md.
"""

__version__ = "0.1.0"
