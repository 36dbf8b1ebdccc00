"""The verification plane: grade an agent's work independently of the agent.

Modules: ``parsers`` (test output of every common runner -> per-test results, by name),
``parsed`` (their shared result type), ``reward`` (results -> SWE-bench score), ``patch``
(which files a diff touches), ``protected`` (which touched files configure or shadow the
runner), ``restore`` (pristine files back), ``tests_verifier`` (the ``tests`` verifier with
real sandboxes), ``answers`` (``rubric``, ``exact``), ``judge`` (``llm_judge``), ``plugins``
(``python``), ``runner`` (one job, any verifier, composition), ``worker`` (the bus wiring).
"""
