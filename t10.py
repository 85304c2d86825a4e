import asyncio, httpx, os, signal, time, subprocess
U="http://127.0.0.1:8767"
async def stream(cl, i):
    try:
        async with cl.stream("POST", U+"/v1/completions", json={"model":"m1","prompt":"a","max_tokens":250,"n":4,"stream":True}, timeout=120) as r:
            last=None; n=0
            async for line in r.aiter_lines():
                if line: last=line; n+=1
            return i, r.status_code, n, last[:40] if last else None
    except Exception as e:
        return i, "EXC", type(e).__name__, str(e)[:100]
async def main(pid):
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as cl:
        t=[asyncio.create_task(stream(cl,i)) for i in range(20)]
        await asyncio.sleep(1.0)
        os.kill(pid, signal.SIGTERM); t0=time.time()
        await asyncio.sleep(0.3)
        try:
            r = await httpx.AsyncClient().get(U+"/health", timeout=3); print("health during drain", r.status_code, r.text)
        except Exception as e: print("health during drain EXC", type(e).__name__, e)
        try:
            r = await httpx.AsyncClient().post(U+"/v1/completions", json={"model":"m1","prompt":"a","max_tokens":3}, timeout=3); print("new req during drain", r.status_code, r.text[:100])
        except Exception as e: print("new req during drain EXC", type(e).__name__, e)
        res = await asyncio.gather(*t)
        for x in res: print(x)
        print("elapsed after TERM", time.time()-t0)
pid = int(subprocess.check_output(["pgrep","-f","port 8767"]).split()[0])
print("pid", pid)
asyncio.run(main(pid))
