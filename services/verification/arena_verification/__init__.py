"""The verification plane: grade an agent's work independently of the agent.

docs/verification.md has the table of its modules, the messages, the verifiers and the rules.
"""
