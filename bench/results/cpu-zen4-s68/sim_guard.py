"""The guard against plain steps timed under other load, simulated with the test suite's policy
(tests/test_policy.py): N plain steps at F times their cost, then a quiet machine where a
speculative round gives 2 tokens in 2.2 plain steps; speculative rounds per 250, with and
without PLAIN_AGE. Measurement only."""
import sys
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), "..", "..", ".."))
from tests.test_policy import _tables, LinearCost, FittedPolicy, SpecConfig
def run(age, contended=6, factor=2.0, spec_cost=2.2, n=3000):
    policy = FittedPolicy(_tables(easy_accept=0.7), LinearCost(a=10.0, b=1.0, c=0.5, e=0.5), SpecConfig(top_k=4, depth=1, total_tokens=4))
    policy.PLAIN_AGE = age
    spec = policy.plan(1)
    p_ms = spec.alternative.expected["plain"]["ms"]
    for _ in range(contended):
        policy.observe(spec, [0], [1], seconds=1e-3 * spec_cost * p_ms)
        policy.observe(spec.alternative, [], [], seconds=1e-3 * factor * p_ms)
    kinds = []
    for i in range(n):
        p = policy.round_plan(1, tokens_left=1000)
        kinds.append(p.speculate)
        policy.observe(p, [0] if p.speculate else [], [1] if p.speculate else [], seconds=1e-3 * (spec_cost if p.speculate else 1.0) * p_ms)
    blocks = [sum(kinds[j:j + 250]) for j in range(0, n, 250)]
    return blocks, policy.plain_scale(1), policy.realized(1)
for age in (0.99, 1.0):
    for contended, factor in ((6, 2.0), (30, 1.7), (54, 1.7)):
        print(age, contended, factor, run(age, contended, factor))
