"""A model, not a measurement: how many bytes of the Gluon backward's Q_i, dO_i and dQ_i tiles an L2 of a given size
would have to fetch from (and write back to) memory on one causal document (32 query / 8 key-value heads, head dim
128), for the orders its programs can start in (attention_hopper_kernel._attn_bwd_hopper's KV_GROUP): key/value
heads in groups of G, inside a group key tile 0 of each head first, then key tile 1, ...; G = 8 is every head
interleaved. 132 programs at a time, started in that order, every program one step per time unit, its steps as
_bwd_step gives them (each query head of the group in turn over the query tiles from the diagonal); the L2 an LRU
cache of whole tiles. Also the time units the walk takes (load balance: the ideal is the steps / 132).
python l2_model.py [T] > l2_model.txt     (CPU, about a minute per line)"""
import sys
from collections import OrderedDict

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
BM, BN, HKV, GQA, SMS, D = 64, 128, 8, 4, 132, 128
QT, KT = T // BM, T // BN


def walk(kvh, j):  # (query head, query tile) of every step of the program of key tile j, as _bwd_step gives them
    i0 = j * BN // BM
    n_qt = QT - i0
    return [(kvh * GQA + it // n_qt, i0 + it % n_qt) for it in range(GQA * n_qt)]


def model(group, l2_mb):
    order = [(g + k, j) for g in range(0, HKV, group) for j in range(KT) for k in range(min(group, HKV - g))]
    cache, size, cap = OrderedDict(), 0, l2_mb * 2 ** 20
    fetched = written = touched = 0

    def touch(key, nbytes, dirty):
        nonlocal size, fetched, written
        if key in cache:
            cache.move_to_end(key)
            cache[key] = (nbytes, cache[key][1] or dirty)
            return
        fetched += nbytes  # a reduction's tile too: the L2 reads the old sum to add to it
        cache[key] = (nbytes, dirty)
        size += nbytes
        while size > cap:
            _, (b, d) = cache.popitem(last=False)
            size -= b
            written += b if d else 0

    running, nxt, units = [None] * SMS, 0, 0
    while True:
        busy = False
        for s in range(SMS):
            if running[s] is None or running[s][1] == len(running[s][0]):
                running[s] = None
                if nxt < len(order):
                    running[s] = [walk(*order[nxt]), 0]
                    nxt += 1
                else:
                    continue
            h, qt = running[s][0][running[s][1]]
            touch(("q", h, qt), BM * D * 2, False)
            touch(("do", h, qt), BM * D * 2, False)
            touch(("dq", h, qt), BM * D * 4, True)
            touched += BM * D * 8
            running[s][1] += 1
            busy = True
        if not busy:
            break
        units += 1
    return units, touched / 1e9, fetched / 1e9, written / 1e9


if __name__ == "__main__":
    steps = HKV * GQA * sum(QT - j * BN // BM for j in range(KT))
    print(f"T={T}: {steps} steps, ideally {steps / SMS:.0f} time units on {SMS} SMs; Q, dO and dQ hold "
          f"{HKV * GQA * T * D * 8 / 1e9:.2f} GB")
    print("heads in groups of   L2     time units  tile bytes  fetched  written back   (GB)")
    for group, mb in ((8, 50), (4, 50), (2, 50), (1, 50), (8, 40), (2, 40), (1, 40)):
        units, touched, fetched, written = model(group, mb)
        print(f"{group:>18}   {mb} MB  {units:10d}  {touched:10.2f}  {fetched:7.2f}  {written:8.2f}", flush=True)
