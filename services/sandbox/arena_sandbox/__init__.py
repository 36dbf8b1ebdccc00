"""Arena's sandbox plane: runs an agent under the sandbox contract and reports the result.

``arena_sandbox.local`` is the bubblewrap provider primitive (also used by the
verification plane), ``runner`` the per-job logic, ``worker`` the NATS wiring.
"""
