// Join a run with the real @tanstack/ai-client; one JSON line per chunk, then {"end": ...}.
// URLS: comma-separated base URLs; request i goes to URLS[min(i, n-1)] (a load balancer).
import { fetchServerSentEvents } from '@tanstack/ai-client'
const urls = process.env.URLS.split(',')
const route = process.env.ROUTE ?? '/api/chat'
const runId = process.env.RUN_ID
const signal = AbortSignal.timeout(Number(process.env.TIMEOUT_MS ?? '30000'))
let n = 0
const fetchClient = (url, init) => {
  const base = urls[Math.min(n++, urls.length - 1)]
  const u = new URL(url)
  const target = base + u.pathname + u.search
  console.log(JSON.stringify({ request: target, lastEventId: init?.headers?.['Last-Event-ID'] ?? null }))
  return fetch(target, init)
}
const conn = fetchServerSentEvents(urls[0] + route, { reconnect: { maxAttempts: 3, delayMs: 200 }, signal, fetchClient })
try {
  for await (const c of conn.joinRun(runId, signal)) console.log(JSON.stringify({ chunk: c }))
  console.log(JSON.stringify({ end: signal.aborted ? 'timeout' : 'done' }))
} catch (e) {
  console.log(JSON.stringify({ end: 'error', name: e?.name, message: e?.message }))
}
process.stdout.write("", () => process.exit(0))
