"""An out-of-tree EPP plugin package: ``session-affinity-scorer``.

Installed next to the EPP, it is found through the ``epp.plugins`` entry-point group
(``register`` below) and configured like any in-tree scorer.
"""

from epp_session_affinity.scorer import (
    TYPE,
    SessionAffinityParameters,
    SessionAffinityScorer,
    register,
)

__all__ = ["TYPE", "SessionAffinityParameters", "SessionAffinityScorer", "register"]
