"""A Hugging Face Llama at Llama 3's vocabulary: memtrain's chunked loss against the model's own
``labels=`` loss, one training step's peak memory and tokens/s, in the same run.

Both sides train the same model (built from ``LlamaConfig``: 2 layers of width 256 with tied
embeddings, so that the vocabulary's tensors dominate as they do in a small modern LM; nothing
downloaded), on the same tokens, with AdamW and gradient clipping, in fp32 on this CPU:
- (p) the peer: ``model(input_ids, labels=input_ids).loss.backward()``, as the Hugging Face
  docs train a causal LM: the full ``(B, T, V)`` logits, their fp32 copy and their gradients;
- (m) memtrain: the same model as ``model.name: hf:<dir>`` builds it (``trainer.models.hf``), with
  ``memory.loss_chunk_tokens: auto`` (512-token chunks at this vocabulary), through the
  trainer's own ``train_step``.
The peak is the CPU allocator's record over one step
(``trainer.telemetry.diagnostics.cpu_peak_bytes``), counting the parameters, AdamW's state and the
tokens held before it; tokens/s is the median of ``--steps`` steps, the two sides alternating.
Targets: (p) / (m) peak >= 3x at (m) / (p) tokens/s >= 0.95x. Run: ``make bench-hf`` (writes
``bench/results/hf-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers

from bench.results import describe_cpu, write_json
from trainer.memory.loss import set_loss_chunking
from trainer.memory.precision import precision_policy
from trainer.models.hf import HFCausalLM
from trainer.optim import build_optimizer
from trainer.step import create_optimizer_state, train_step
from trainer.telemetry.diagnostics import cpu_peak_bytes


def llama(vocab_size: int, seq_len: int) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(  # tied embeddings, as Llama 3.2's small models have
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
        tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def peer_step(model: Any, optimizer: torch.optim.Optimizer, tokens_BT: torch.Tensor) -> None:
    """The Hugging Face way: the model's own loss over the full logits."""
    loss = model(input_ids=tokens_BT, labels=tokens_BT, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=128_256)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokens_BT = torch.randint(0, args.vocab_size, (args.micro_batch, args.seq_len + 1))
    policy = precision_policy("fp32", torch.device("cpu"), warn=False)

    peer = llama(args.vocab_size, args.seq_len + 1)
    peer_opt = build_optimizer(peer, 3e-4)
    create_optimizer_state(peer_opt)
    ours = HFCausalLM(llama(args.vocab_size, args.seq_len + 1))
    chunk = set_loss_chunking(ours, "auto")
    ours_opt = build_optimizer(ours, 3e-4)
    create_optimizer_state(ours_opt)
    scaler = policy.grad_scaler(torch.device("cpu"))

    def run_peer() -> None:
        peer_step(peer, peer_opt, tokens_BT[:, :-1])

    def run_ours() -> None:
        train_step(ours, ours_opt, scaler, [tokens_BT], 1, policy, 1.0)

    def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        return [*model.parameters(), *state, tokens_BT]

    peaks = {"peer": cpu_peak_bytes(run_peer, held=held(peer, peer_opt)),
             "memtrain": cpu_peak_bytes(run_ours, held=held(ours, ours_opt))}
    seconds: dict[str, list[float]] = {"peer": [], "memtrain": []}
    for _ in range(args.steps):  # alternating, so a slow moment of the VM hits both
        for name, run in (("peer", run_peer), ("memtrain", run_ours)):
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    tokens = args.micro_batch * args.seq_len
    tps = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    report = {
        "model": {"family": "llama", "vocab_size": args.vocab_size, "seq_len": args.seq_len,
                  "micro_batch": args.micro_batch, "hidden_size": 256, "layers": 2,
                  "params": sum(p.numel() for p in peer.parameters())},
        "loss_chunk_tokens": chunk, "peak_bytes": peaks, "tokens_per_second": tps,
        "step_seconds": seconds, "threads": torch.get_num_threads(),
        "peak_ratio": peaks["peer"] / peaks["memtrain"],
        "speed_ratio": tps["memtrain"] / tps["peer"],
    }
    path = write_json(args.out, "hf", report)
    gib = 2**30
    print(f"{describe_cpu(report['cpu'])}; Llama, vocabulary {args.vocab_size:,}, sequence "
          f"{args.seq_len}, micro-batch {args.micro_batch}, fp32, {report['threads']} threads")
    print(f"(p) HF labels= loss: peak {peaks['peer'] / gib:.2f} GiB, {tps['peer']:,.0f} tokens/s")
    print(f"(m) memtrain, chunks of {chunk}: peak {peaks['memtrain'] / gib:.2f} GiB, "
          f"{tps['memtrain']:,.0f} tokens/s")
    print(f"peak (p)/(m) {report['peak_ratio']:.2f}x (target >= 3x); tokens/s (m)/(p) "
          f"{report['speed_ratio']:.3f}x (target >= 0.95x); {path}")


if __name__ == "__main__":
    main()
