"""The verification plane: verify an agent's diff on the pristine task in a fresh sandbox.

Modules: ``pytest_parser`` (pytest output -> per-test results), ``reward`` (results ->
SWE-bench score), ``patch`` (which files a diff touches), ``restore`` (pristine test
files back), ``runner`` (one job end to end), ``worker`` (the bus wiring).
"""
