// Benchmark helper (bench/delivery_bench.py): the real @tanstack/ai-client joins
// a run on a live `threadlog serve` and notes, for every chunk carrying `t`
// (the producer's wall clock just before `append`, epoch ms), how long after
// that it reached this client. Prints one JSON line: {latenciesMs: [...]}.
//   THREADLOG_URL, RUN_ID (and ROUTE, default /api/chat)

import { fetchServerSentEvents } from '@tanstack/ai-client'

const route = process.env.ROUTE ?? '/api/chat'
const connection = fetchServerSentEvents(`${process.env.THREADLOG_URL}${route}`)
const deadline = AbortSignal.timeout(300_000)
const latenciesMs = []
let attached = false
for await (const chunk of connection.joinRun(process.env.RUN_ID, deadline)) {
  const now = performance.timeOrigin + performance.now()
  if (typeof chunk.t === 'number') latenciesMs.push(now - chunk.t)
  if (!attached) {
    // The first (untimed) chunk arrived: the stream is live, the producer may start.
    attached = true
    process.stdout.write('ready\n')
  }
}
process.stdout.write(JSON.stringify({ latenciesMs }) + '\n')
