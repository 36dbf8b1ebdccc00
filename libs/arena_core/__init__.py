"""Arena's core contract: message schemas, subjects, errors, settings, the bus and telemetry.

Every service and client depends on this package; it depends on none of them.
See docs/architecture.md.
"""
