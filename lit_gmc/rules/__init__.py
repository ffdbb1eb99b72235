"""The off-policy rules, one class per file; importing this package registers them all.

Each is a :class:`lit_gmc.corrections.Correction` subclass, chosen with ``--model.correction <ClassName>`` (or a
``class_path``) and configured with its own options (``--model.correction.cap``, ``--model.correction.clip``, ...).
A user's rule is a subclass in the user's own module, named by its import path.
"""

from lit_gmc.rules.a3po import A3PO
from lit_gmc.rules.cispo import CISPO
from lit_gmc.rules.gac import GAC
from lit_gmc.rules.gmc import GMC
from lit_gmc.rules.grpo import GRPO
from lit_gmc.rules.importance import IS
from lit_gmc.rules.tic import TIC
from lit_gmc.rules.tis import TIS
from lit_gmc.rules.vcpo import VCPO

__all__ = ["A3PO", "CISPO", "GAC", "GMC", "GRPO", "IS", "TIC", "TIS", "VCPO"]
