"""Probe: does a few-step Lloyd adaptation of FibQuant's universal codebook on a layer/head's own
rotated key/value blocks lower the error on held-out tokens of the same text? (k=8, N=256: b=1)"""
import sys, torch
torch.set_num_threads(1)
from fibquant.kv.model import load_model
from fibquant.eval.kv_report import text_tokens
from fibquant.eval.needle import prefill
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codebook.nearest import nearest_codeword

model, tok = load_model()
ids = text_tokens(tok, "emma", 2048)
cache = prefill(model, ids)
codec = FibQuantCodec.for_rate(64, float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
forward = codec.rotated_codebook(torch.device("cpu")).forward
cw0 = codec.codebook.codewords.float()
k = codec.k
rows = []
for role in ("keys", "values"):
    for layer in range(0, 30, 3):
        for head in range(3):
            x = getattr(cache.layers[layer], role)[0, head, 4:].float()
            x = x - x[:1024].mean(0) if "--centre" in sys.argv else x
            u = (x / x.norm(dim=1, keepdim=True)) @ forward
            train, test = u[:1024].reshape(-1, k), u[1024:].reshape(-1, k)
            def mse(cw, blocks):
                idx = nearest_codeword(blocks, cw, (cw ** 2).sum(-1))
                return float(((cw[idx] - blocks) ** 2).sum(-1).mean())
            cw = cw0.clone()
            for _ in range(5):
                idx = nearest_codeword(train, cw, (cw ** 2).sum(-1))
                sums = torch.zeros_like(cw).index_add_(0, idx, train)
                counts = torch.bincount(idx, minlength=cw.shape[0]).float()
                cw = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], cw)
            rows.append((role, layer, head, mse(cw0, test), mse(cw, test)))
for role in ("keys", "values"):
    r = [x for x in rows if x[0] == role]
    u = sum(x[3] for x in r) / len(r); a = sum(x[4] for x in r) / len(r)
    print(f"{role}: universal MSE {u:.5f}, adapted (5 Lloyd steps on tokens 4..1027, tested on 1028..2047) {a:.5f}: {100*(1-a/u):.1f}% lower")
