import time, sys
t0 = time.monotonic()
def p(what): print(f"{time.monotonic()-t0:7.1f}s {what}", flush=True)
import dask, numpy as np
p("import dask numpy")
import distributed
p("import distributed")
import pandas as pd, dask.dataframe as dd, dask.array as da
p("import pandas dask.dataframe dask.array")
from distributed import Client, LocalCluster

def main():
    with LocalCluster(protocol=sys.argv[1], n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        p("cluster up")
        client.wait_for_workers(2)
        p("workers up")
        print(client.run(lambda: 1))
        p("run")
        x = da.random.default_rng(42).random((1200, 1200), chunks=300)
        r = ((x + x.T).sum(axis=0) - x.mean(axis=1)).compute()
        p("array 1")
        r = ((x + x.T).sum(axis=0) - x.mean(axis=1)).compute()
        p("array 2")
        rng = np.random.default_rng(7)
        df = pd.DataFrame({"k": rng.integers(0, 60, 30_000), "v": rng.random(30_000)})
        ddf = dd.from_pandas(df, npartitions=6)
        out = ddf.shuffle(on="k", npartitions=4, shuffle_method="p2p").compute()
        p("shuffle 1")
        out = ddf.shuffle(on="k", npartitions=4, shuffle_method="p2p").compute()
        p("shuffle 2")
    p("closed")

if __name__ == '__main__':
    main()
