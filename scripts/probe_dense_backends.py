"""Which dense attention backend the warmup path should call on this GPU and torch: times and checks
aten's flash and cuDNN kernels (fwd+bwd, GQA, lse convention, packed varlen, determinism) in the bench
configuration. python scripts/probe_dense_backends.py [N ...]"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402

A = torch.ops.aten


def timeit(fn, reps=10):
    """Median ms of fn() (msa.bench's timer: CUDA events, two warm-up calls)."""
    return bench.Timer(torch.device("cuda"), reps)(fn, [()])


def main():
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
    for n in ("_cudnn_attention_forward", "_cudnn_attention_backward", "_scaled_dot_product_cudnn_attention"):
        print(n, "present" if hasattr(A, n) else "absent", getattr(A, n).default._schema if hasattr(A, n) else "")
    ns = [int(a) for a in sys.argv[1:]] or [8192, 32768]
    for N in ns:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(N, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(N, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(N, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        do = torch.randn_like(q)
        sc = 128 ** -0.5
        cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
        fo, fl = A._flash_attention_forward(q, k, v, cu, cu, N, N, 0.0, True, False, scale=sc)[:2]
        rng = torch.zeros(2, dtype=torch.int64, device="cuda")
        un = torch.empty(0, dtype=torch.int64, device="cuda")
        fwd_f = timeit(lambda: A._flash_attention_forward(q, k, v, cu, cu, N, N, 0.0, True, False, scale=sc))
        bwd_f = timeit(lambda: A._flash_attention_backward(do, q, k, v, fo, fl, cu, cu, N, N, 0.0, True, rng, un,
                                                           scale=sc))
        print(f"N={N} flash: fwd {fwd_f:.3f} bwd {bwd_f:.3f} ms, lse {tuple(fl.shape)} {fl.dtype} {fl.stride()}")
        Q, K, V, DO = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v, do))
        try:
            r = A._scaled_dot_product_cudnn_attention(Q, K, V, None, True, 0.0, True, False, scale=sc)
            co, cl = r[0], r[1]
            print(f"  cudnn bhsd: out {tuple(co.shape)} {co.stride()} lse {tuple(cl.shape)} {cl.dtype} {cl.stride()}")
            err = (co.transpose(1, 2)[0].float() - fo.float()).abs().max().item()
            lerr = (cl.reshape(16, N).float() - fl.reshape(16, N).float()).abs().max().item()
            print(f"  cudnn vs flash: out max err {err:.3e}, lse max err {lerr:.3e} (lse mean {cl.mean().item():.3f} vs {fl.mean().item():.3f})")
            fwd_c = timeit(lambda: A._scaled_dot_product_cudnn_attention(Q, K, V, None, True, 0.0, True, False, scale=sc))

            def cb():
                return A._scaled_dot_product_cudnn_attention_backward(DO, Q, K, V, co, cl, r[6], r[7], None, r[2],
                                                                      r[3], N, N, 0.0, True, scale=sc)
            bwd_c = timeit(cb)
            g1, g2 = cb(), cb()
            det = all(torch.equal(a, b) for a, b in zip(g1, g2))
            gf = A._flash_attention_backward(do, q, k, v, fo, fl, cu, cu, N, N, 0.0, True, rng, un, scale=sc)
            gerr = [(a.transpose(1, 2)[0].float() - b.float()).abs().max().item() for a, b in zip(g1, gf)]
            print(f"  cudnn: fwd {fwd_c:.3f} bwd {bwd_c:.3f} ms; bwd bitwise repeatable {det}; grad shapes "
                  f"{[tuple(x.shape) for x in g1]} strides {[x.stride() for x in g1]}; vs flash {gerr}")
        except Exception as e:  # noqa: BLE001
            print("  cudnn bhsd failed:", type(e).__name__, str(e)[:300])
        if hasattr(A, "_cudnn_attention_forward"):
            try:
                half = N // 2 + 64
                cu2 = torch.tensor([0, half, N], dtype=torch.int32, device="cuda")
                r = A._cudnn_attention_forward(q, k, v, None, cu2, cu2, half, half, True, 0.0, True, False, scale=sc)
                f2o, f2l = A._flash_attention_forward(q, k, v, cu2, cu2, half, half, 0.0, True, False, scale=sc)[:2]
                err = (r[0].float() - f2o.float()).abs().max().item()
                print(f"  cudnn varlen: out {tuple(r[0].shape)} lse {tuple(r[1].shape)} {r[1].stride()}; out err vs flash {err:.3e}")
                try:
                    lerr = (r[1].reshape(f2l.shape).float() - f2l.float()).abs().max().item()
                    print(f"  cudnn varlen lse err {lerr:.3e} (flash lse {tuple(f2l.shape)})")
                except Exception as e:  # noqa: BLE001
                    print("  lse compare failed", e)
                fwd_v = timeit(lambda: A._cudnn_attention_forward(q, k, v, None, cu2, cu2, half, half, True, 0.0, True,
                                                                  False, scale=sc))
                rb = A._cudnn_attention_backward(do, q, k, v, r[0], r[1], r[6], r[7], None, cu2, cu2, half, half, 0.0,
                                                 True, scale=sc)
                gf = A._flash_attention_backward(do, q, k, v, f2o, f2l, cu2, cu2, half, half, 0.0, True, rng, un,
                                                 scale=sc)
                gerr = [(a.float() - b.float()).abs().max().item() for a, b in zip(rb, gf)]
                bwd_v = timeit(lambda: A._cudnn_attention_backward(do, q, k, v, r[0], r[1], r[6], r[7], None, cu2, cu2,
                                                                   half, half, 0.0, True, scale=sc))
                print(f"  cudnn varlen: fwd {fwd_v:.3f} bwd {bwd_v:.3f} ms; grads vs flash {gerr}")
            except Exception as e:  # noqa: BLE001
                print("  cudnn varlen failed:", type(e).__name__, str(e)[:400])


if __name__ == "__main__":
    main()
