"""The python grader sandbox's isolation levels, weakest first (agent_rft/graders/sandbox.py probes which
one a machine allows). Imports nothing of the service: app/core/config.py types its settings with it.

- `audit_hook`: no namespace could be had; only the in-process audit hook (PEP 578, which says
  audit hooks are not a sandbox) keeps the grader off the network and the service's files.
- `root_netns`: a network namespace, but the grader keeps the root service's uid and capabilities.
- `user_netns`: uid 0 inside a user + network namespace: no network, no capabilities outside it.
- `uid_drop_netns`: a network namespace and the unprivileged `nobody` user, so the kernel's own
  file permissions protect the service's files too.
"""

from __future__ import annotations

from enum import StrEnum


class PythonIsolation(StrEnum):
    AUDIT_HOOK = "audit_hook"
    ROOT_NETNS = "root_netns"
    USER_NETNS = "user_netns"
    UID_DROP_NETNS = "uid_drop_netns"

    @property
    def rank(self) -> int:
        return list(PythonIsolation).index(self)

    def at_least(self, required: "PythonIsolation") -> bool:
        return self.rank >= PythonIsolation(required).rank

    def describe(self) -> str:
        return _DESCRIPTIONS[self]


STRONGEST = PythonIsolation.UID_DROP_NETNS
# Where nothing stricter is asked for: outside the embedded default, a network namespace at least.
DEFAULT_OUTSIDE_EMBEDDED = PythonIsolation.ROOT_NETNS
_DESCRIPTIONS = {
    PythonIsolation.AUDIT_HOOK: "an audit hook only, no network namespace",
    PythonIsolation.ROOT_NETNS: "a network namespace, as the service's root user",
    PythonIsolation.USER_NETNS: "uid 0 in a user + network namespace",
    PythonIsolation.UID_DROP_NETNS: "the nobody user in a network namespace",
}
