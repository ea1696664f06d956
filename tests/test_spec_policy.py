"""The segment policy: parsing (with the bad inputs named), first-match-wins matching, canary hashing, and the
speculative config that carries it."""

import pytest

from spec_jax import spec_config
from spec_jax.spec_policy import Features, parse_canary, parse_policy

POLICY = [
    {"match": {"temperature": "zero", "prompt_tokens": [0, 256]}, "num_speculative_tokens": 4},
    {"match": {"segment": "code"}, "num_speculative_tokens": 2, "name": "code"},
    {"match": {"temperature": "zero", "busy_slots": [1, 3]}, "num_speculative_tokens": 3},
    {"match": {"max_tokens": [0, 64]}, "num_speculative_tokens": 1},
    {"match": {}, "num_speculative_tokens": 0},
]


def _f(t=0.0, p=10, m=128, busy=1, seg=""):
  return Features(temperature=t, prompt_tokens=p, max_tokens=m, busy_slots=busy, segment=seg)


def test_first_matching_rule_wins_and_buckets_are_half_open():
  pol = parse_policy(POLICY)
  assert pol.names == ("temperature=zero,prompt_tokens=0-256", "code", "temperature=zero,busy_slots=1-3",
                       "max_tokens=0-64", "default")
  assert pol.pick(_f()).k == 4
  assert pol.pick(_f(p=256)).k == 3  # [0, 256): 256 is out; busy 1 in [1, 3)
  assert pol.pick(_f(p=256, busy=3)).k == 0
  assert pol.pick(_f(t=0.7, seg="code")).k == 2
  assert pol.pick(_f(t=0.7, seg="cod")).name == "default"  # tags compare as is
  assert pol.pick(_f(t=0.7, m=63)).k == 1 and pol.pick(_f(t=0.7, m=64)).k == 0
  assert pol.pick(_f(t=1e-6)).name == "default"  # any temperature above 0 is nonzero
  assert pol.k_max == 4


def test_open_buckets_and_round_trip_through_the_speculative_config():
  rules = [{"match": {"prompt_tokens": [512, None]}, "num_speculative_tokens": 0, "name": "long"},
           {"match": {}, "num_speculative_tokens": 4}]
  pol = parse_policy(rules)
  assert pol.pick(_f(p=10 ** 6)).name == "long" and pol.pick(_f(p=511)).k == 4
  cfg = spec_config.from_dict({"method": "ngram", "policy": rules,
                               "canary": {"fraction": 0.25, "policy": [{"match": {}, "num_speculative_tokens": 2}]}})
  assert cfg.num_speculative_tokens == 4  # the largest rule k when not given
  assert spec_config.from_dict(cfg.to_json()) == cfg
  assert "policy long:0, default:4" in cfg.describe()


@pytest.mark.parametrize("rules, msg", [
    ([], "non-empty list"),
    ([{"match": {}, "num_speculative_tokens": 4}, {"match": {}, "num_speculative_tokens": 0}], "used twice"),
    ([{"match": {"temperature": "zero"}, "num_speculative_tokens": 4}], r"policy\[0\]: the last rule must match"),
    ([{"match": {"temp": "zero"}, "num_speculative_tokens": 4}, {"num_speculative_tokens": 0}],
     r"policy\[0\]: unknown match keys \['temp'\]"),
    ([{"match": {"temperature": "hot"}, "num_speculative_tokens": 4}, {"num_speculative_tokens": 0}],
     r"policy\[0\]: temperature must be"),
    ([{"match": {"prompt_tokens": [64, 64]}, "num_speculative_tokens": 4}, {"num_speculative_tokens": 0}],
     r"policy\[0\]: prompt_tokens bucket \[64, 64\) is empty"),
    ([{"match": {"busy_slots": [1]}, "num_speculative_tokens": 4}, {"num_speculative_tokens": 0}],
     r"policy\[0\]: busy_slots must be a \[lo, hi\) bucket"),
    ([{"match": {}, "num_speculative_tokens": -1}], r"policy\[0\]: num_speculative_tokens must be"),
    ([{"match": {}, "num_speculative_tokens": True}], r"policy\[0\]: num_speculative_tokens must be"),
    ([{"match": {}, "k": 4}], r"policy\[0\]: unknown keys \['k'\]"),
    (["zero"], r"policy\[0\]: a rule is an object"),
    ([{"match": {"segment": ""}, "num_speculative_tokens": 1}, {"num_speculative_tokens": 0}],
     r"policy\[0\]: segment must be"),
])
def test_bad_policies_name_the_rule(rules, msg):
  with pytest.raises(ValueError, match=msg):
    parse_policy(rules)


def test_bad_configs_around_the_policy():
  with pytest.raises(ValueError, match=r"policy\[0\]: num_speculative_tokens 6 exceeds"):
    spec_config.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                           "policy": [{"match": {}, "num_speculative_tokens": 6}]})
  with pytest.raises(ValueError, match="per_concurrency and policy"):
    spec_config.from_dict({"method": "ngram", "per_concurrency": {"1": {"num_speculative_tokens": 2}},
                           "policy": [{"match": {}, "num_speculative_tokens": 2}]})
  with pytest.raises(ValueError, match="canary needs a policy"):
    spec_config.from_dict({"method": "ngram", "canary": {"fraction": 0.1, "policy": [{"num_speculative_tokens": 1}]}})
  with pytest.raises(ValueError, match="fraction must be"):
    parse_canary({"fraction": 1.5, "policy": [{"num_speculative_tokens": 1}]})


def test_canary_takes_its_share_by_content_so_retries_land_in_the_same_arm():
  c = parse_canary({"fraction": 0.2, "policy": [{"match": {}, "num_speculative_tokens": 1}]})
  keys = [f"prompt {i}".encode() for i in range(4000)]
  share = sum(c.takes(k) for k in keys) / len(keys)
  assert 0.17 < share < 0.23
  assert all(c.takes(k) == c.takes(bytes(k)) for k in keys[:50])  # deterministic: a retry lands in the same arm
