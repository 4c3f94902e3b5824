"""`edgerun bench tp --loss-at kernel`: real kernel loss on loopback reaches both transports."""

from __future__ import annotations

import pytest

from edgerun.bench import tp as bench
from edgerun.bench.tp import TpBenchConfig, bench_tp
from edgerun.net.kernel_loss import loss_supported

pytestmark = pytest.mark.slow  # kernel packet loss


def test_kernel_loss_reaches_udp_and_tcp(tiny_spec, synth_gguf, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = loss_supported()
    if reason is not None:
        pytest.skip(reason)
    path = synth_gguf(tiny_spec(tied=False))
    # Without parity, so that a lost datagram shows as an incomplete block rather than a rebuilt one.
    # minmax: the node takes a share (halo leaves it out of a model this small, its synchronizations cost more).
    config = TpBenchConfig(path, plan="minmax", tokens=8, timeout_ms=None, parity=0, loss_at="kernel")
    rebalances = []  # the split the first row made and rebalanced serves every later row, of either transport

    def rebalance(master: bench.Master, model: bench.Model) -> bool:
        rebalances.append(master.config.transport)
        return original(master, model)

    original = bench._rebalance
    monkeypatch.setattr(bench, "_rebalance", rebalance)
    results = bench_tp(config, [1], ["0", "20%"], ["udp", "tcp"])
    assert rebalances == ["udp"]
    by = {(r.setup.transport, r.setup.loss): r for r in results}
    assert set(by) == {("udp", "0"), ("tcp", "0"), ("udp", "20%"), ("tcp", "20%")}
    for r in results:
        assert r.tokens == 8 and r.setup.loss_at == "kernel" and r.setup.timeout == "adaptive"
    assert by[("udp", "0")].packets.kernel_matched == 0  # no table at rate 0
    for transport in ("udp", "tcp"):
        lossy = by[(transport, "20%")].packets
        assert lossy.kernel_matched > 0
        # 20% of the cluster's packets, within 6 binomial standard deviations
        share = lossy.kernel_dropped / lossy.kernel_matched
        sigma = (0.2 * 0.8 / lossy.kernel_matched) ** 0.5
        assert abs(share - 0.2) < 6 * sigma + 0.01, (transport, share)
    # The same shares at both rates and on both transports: every ratio compares the same devices.
    shares = [[(d.name, d.weight_mb, d.attn_units, d.mlp_groups, d.vocab_blocks) for d in r.split.devices]
              for r in results]
    assert all(s == shares[0] for s in shares) and shares[0], shares
    assert all(r.split.computed_on == results[0].split.computed_on for r in results)
    assert by[("tcp", "20%")].blocks.incomplete == 0  # tcp waits for everything
    assert by[("udp", "20%")].blocks.incomplete > 0  # udp gives up on what was lost
    # The links lost packets: with --transport udp the prompt's inputs went on the node's spare stream as well; the
    # strict tcp baseline has one stream. (At rate 0 a busy machine may still make a partial miss its adaptive
    # deadline, which marks the link lossy too: that row is not asked about.)
    assert by[("udp", "20%")].blocks.prompt_inputs_doubled > 0 and by[("tcp", "20%")].blocks.prompt_inputs_doubled == 0
