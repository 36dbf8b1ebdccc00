"""Arena's sandbox plane: runs an agent under the sandbox contract and reports the result.

``provider`` is the interface, implemented by ``local_provider`` (bubblewrap, on the
``local`` primitive that the verification plane also uses), ``docker_provider`` and
``mock_provider``; ``pool`` the warm pool, ``runner`` the per-job logic, ``worker``
the NATS wiring.
"""
