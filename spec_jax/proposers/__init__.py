"""Draft sources behind one protocol (see base.py)."""

from spec_jax.proposers.base import Draft, NoneProposer, Proposer, ProposeContext, VerifyResult

__all__ = ["Draft", "NoneProposer", "Proposer", "ProposeContext", "VerifyResult"]
