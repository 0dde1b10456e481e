"""An out-of-tree EPP plugin package: ``sticky-session-scorer``.

Installed next to the EPP, it is found through the ``epp.plugins`` entry-point group
(``register`` below) and configured like any in-tree scorer.
"""

from epp_sticky_sessions.scorer import (
    TYPE,
    SessionAffinityParameters,
    SessionAffinityScorer,
    register,
)

__all__ = ["TYPE", "SessionAffinityParameters", "SessionAffinityScorer", "register"]
