"""Arena's sandbox plane: runs an agent under the sandbox contract and reports the result.

``pool`` is the warm pool, ``runner`` the per-job logic, ``worker`` the NATS wiring; sandboxes
come from ``arena_sandbox_providers``. See docs/sandbox.md.
"""
