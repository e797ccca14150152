// The real @tanstack/ai-client against a live `threadlog serve`, through a TCP
// proxy that cuts the first joinRun connection mid-stream.
//
// Driven by tests/test_node_interop.py, which appends the chunks from Python
// and compares. Environment:
//   THREADLOG_URL  base URL of `threadlog serve` (e.g. http://127.0.0.1:8123)
//   ROUTE          the durability route path (default /api/chat)
//   THREAD_ID      thread to hydrate
//   RUN_ID         run to join
//   DROP_AFTER     cut the first join connection after this many SSE events
// Prints one JSON line: {hydrate, chunks, requests, dropped}.

import net from 'node:net'
import { fetchServerSentEvents } from '@tanstack/ai-client'

const target = new URL(process.env.THREADLOG_URL)
const route = process.env.ROUTE ?? '/api/chat'
const threadId = process.env.THREAD_ID
const runId = process.env.RUN_ID
const dropAfter = Number(process.env.DROP_AFTER ?? '0')

const requests = []
let dropped = false

// A byte-level proxy: HTTP/1.1 keep-alive means one socket may carry the
// hydrate GET and then the join GET, so the join is recognized by its request
// line, and every server byte after it belongs to the join's response.
const proxy = net.createServer((client) => {
  const upstream = net.connect(Number(target.port), target.hostname)
  let head = ''
  let counting = false
  let events = 0
  client.on('data', (buf) => {
    head += buf.toString('latin1')
    let end
    while ((end = head.indexOf('\r\n\r\n')) !== -1) {
      const lines = head.slice(0, end).split('\r\n')
      head = head.slice(end + 4)
      const [method, path] = lines[0].split(' ')
      const headers = {}
      for (const line of lines.slice(1)) {
        const i = line.indexOf(':')
        headers[line.slice(0, i).trim().toLowerCase()] = line.slice(i + 1).trim()
      }
      requests.push({ method, path, lastEventId: headers['last-event-id'] ?? null })
      if (!dropped && path.includes('runId=')) {
        counting = true
        events = 0
      }
    }
    upstream.write(buf)
  })
  upstream.on('data', (buf) => {
    if (!counting || dropped) {
      client.write(buf)
      return
    }
    const text = buf.toString('latin1')
    let cut = -1
    let from = 0
    for (;;) {
      const at = text.indexOf('\n\n', from)
      if (at === -1) break
      events += 1
      from = at + 2
      if (events === dropAfter) {
        cut = from
        break
      }
    }
    if (cut === -1) {
      client.write(buf)
      return
    }
    // Forward whole events up to the cut, then drop the connection mid-response.
    dropped = true
    client.write(buf.subarray(0, cut), () => {
      client.destroy()
      upstream.destroy()
    })
  })
  const close = () => {
    client.destroy()
    upstream.destroy()
  }
  client.on('error', close)
  upstream.on('error', close)
  client.on('close', close)
  upstream.on('close', close)
})

await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve))
const base = `http://127.0.0.1:${proxy.address().port}`

const deadline = AbortSignal.timeout(60_000)
const connection = fetchServerSentEvents(`${base}${route}`, {
  reconnect: { maxAttempts: 5, delayMs: 50 },
  signal: deadline,
})

let out
try {
  const hydrate = await connection.hydrate(threadId)
  const chunks = []
  for await (const chunk of connection.joinRun(runId, deadline)) {
    chunks.push(chunk)
  }
  if (deadline.aborted) throw new Error('joinRun did not finish within 60 s')
  out = { hydrate, chunks, requests, dropped }
} catch (err) {
  console.error(`interop failed: ${err?.name}: ${err?.message}`)
  proxy.close()
  process.exit(1)
}
proxy.close()
process.stdout.write(JSON.stringify(out) + '\n')
process.exit(0)
