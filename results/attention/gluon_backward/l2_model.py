"""A model, not a measurement: how many bytes of the Gluon backward's Q_i, dO_i and dQ_i tiles an L2 of a given size
would have to fetch from (and write back to) memory on the 8K document (32 query / 8 key-value heads, head dim 128),
for the two walks of attention_hopper_kernel._bwd_step. 132 programs at a time, taken in the grid's order (key/value
head fastest, key tile 0 first), every program one step per time unit; the L2 an LRU cache of whole tiles.
python l2_model.py     (CPU, about a minute)"""
from collections import OrderedDict

T, BM, BN, HKV, G, SMS, D = 8192, 64, 128, 8, 4, 132, 128
QT = T // BM


def walk(kvh, j, from_end):  # (query head, query tile) of every step, as _bwd_step gives them
    i0 = j * BN // BM
    n_qt = QT - i0
    if from_end:
        return [(kvh * G + it % G, i0 + n_qt - 1 - it // G) for it in range(G * n_qt)]
    return [(kvh * G + it // n_qt, i0 + it % n_qt) for it in range(G * n_qt)]


def model(from_end, l2_mb):
    grid = [(kvh, j) for j in range(T // BN) for kvh in range(HKV)]
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

    running, nxt, steps = [None] * SMS, 0, 0
    while True:
        busy = False
        for s in range(SMS):
            if running[s] is None or running[s][1] == len(running[s][0]):
                running[s] = None
                if nxt < len(grid):
                    running[s] = [walk(*grid[nxt], from_end), 0]
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
        steps += 1
    return steps, touched / 1e9, fetched / 1e9, written / 1e9


if __name__ == "__main__":
    print("walk                     L2      tile bytes  fetched  written back   (GB)")
    for from_end in (False, True):
        for mb in (25, 50):
            steps, touched, fetched, written = model(from_end, mb)
            name = "from the end, heads inner" if from_end else "from the diagonal, heads outer"
            print(f"{name:<30} {mb} MB  {touched:8.2f}  {fetched:8.2f}  {written:8.2f}")
