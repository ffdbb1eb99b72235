"""The estimator lab: every rule's update measured against the true policy gradient, under staleness.

``lit-gmc estimate`` (:mod:`lit_gmc.lab.command`) takes a behaviour policy ``theta_b`` and a current policy ``theta``
(two checkpoints of a run, or the tiny policy trained ``tau`` updates from ``theta_b`` on ``theta_b``'s rollouts) and,
for each rule, group size ``G`` and delay, measures the rule's expected update ``E[g]`` over groups drawn from
``theta_b`` against ``grad J(theta) / T``: its bias, cosine, second moment and variance, beside the paper's bounds.

- :mod:`~lit_gmc.lab.space`: the responses a prompt can get (all of them, up to a few tokens), their log-probs and
  the per-token score vectors ``grad log pi_theta(y_t | x, y_<t)``;
- :mod:`~lit_gmc.lab.measure`: a rule's per-token loss gradients ``dL/d log pi`` on drawn groups, through the rule's
  own ``__call__`` and its aggregation, and the unbiased estimates made from them;
- :mod:`~lit_gmc.lab.run` and :mod:`~lit_gmc.lab.sampled`: one delay measured on enumerated or sampled responses;
- :mod:`~lit_gmc.lab.policies`: the two policies, read or trained; :mod:`~lit_gmc.lab.command`: the command line;
- :mod:`~lit_gmc.lab.report` and :mod:`~lit_gmc.lab.figures`: the table, the figures and the raw numbers.
"""
