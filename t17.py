import asyncio, httpx, os, signal, sys, time
pid=int(sys.argv[1]); sig=getattr(signal, sys.argv[2])
async def stream(cl):
    try:
        async with cl.stream("POST", "http://127.0.0.1:8769/v1/chat/completions", json={"model":"m1","messages":[{"role":"user","content":"x"}],"max_tokens":250,"n":8,"stream":True}, timeout=60) as r:
            n=0; last=None
            async for line in r.aiter_lines():
                if line: n+=1; last=line
                await asyncio.sleep(0.002)
            return r.status_code, n, last[:20]
    except Exception as e: return "EXC", repr(e)[:200]
async def main():
    async with httpx.AsyncClient() as cl:
        ts=[asyncio.create_task(stream(cl)) for _ in range(6)]
        await asyncio.sleep(0.8); os.kill(pid, sig); 
        if len(sys.argv)>3: await asyncio.sleep(0.5); os.kill(pid, sig); print("sent twice")
        print(await asyncio.gather(*ts))
asyncio.run(main())
