"""A tiny byte-level model trained for a few dozen steps, shared by the generation tests."""

import torch

from megamamba import MambaConfig, MambaLM
from megamamba.tokenizer import load_tokenizer

TEXT = ("the cat sat on the mat. the dog sat on the log. " * 8) + ("a b c d e f g h i j k l m n o p. " * 4)
SSM = {
    "Mamba1": {"layer": "Mamba1", "d_state": 8, "dt_rank": 4},
    "Mamba2": {"layer": "Mamba2", "d_state": 8, "headdim": 8, "ngroups": 1, "chunk_size": 16},
}
HYBRID = {
    "n_layer": 3,
    "hybrid_layer_pattern": "M*-",
    "d_intermediate": 48,  # every layer kind, GQA with rotary
    "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 4, "causal": True},
}
STEPS, SEQ, BATCH = 30, 32, 8


def train_tiny(layer: str, seed: int = 0, fields: dict = None):
    """(model in eval mode, tokenizer, [loss of each step]) after STEPS AdamW steps on TEXT; `fields` override
    the config's (HYBRID: a hybrid)."""
    torch.manual_seed(seed)
    tok = load_tokenizer("bytes")
    config = MambaConfig(
        **{"d_model": 32, "n_layer": 2, "vocab_size": tok.vocab_size, "ssm_cfg": SSM[layer], **(fields or {})}
    )
    model = MambaLM(config)
    data = torch.tensor(tok.encode(TEXT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=gen)
        window = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])[..., : config.vocab_size]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.eval(), tok, losses
