// A page reload's rejoin with the real @tanstack/ai-client ChatClient: it holds a
// resume pointer to RUN_ID and rejoins on attach, giving up if no chunk comes
// within its REJOIN_CONNECT_DEADLINE_MS (2 s). One JSON line per chunk, then
// {"end", "messages"} once the rejoin is over (loading went true, then false).
import { ChatClient, fetchServerSentEvents } from '@tanstack/ai-client'
const url = process.env.URL
const threadId = process.env.THREAD_ID
const runId = process.env.RUN_ID
const timeout = setTimeout(() => finish('timeout'), Number(process.env.TIMEOUT_MS ?? '30000'))
let loading = false
let client
function finish(end) {
  clearTimeout(timeout)
  const messages = client.getMessages().map((m) => ({ role: m.role, parts: m.parts }))
  process.stdout.write(JSON.stringify({ end, messages }) + '\n', () => process.exit(0))
}
client = new ChatClient({
  connection: fetchServerSentEvents(url),
  threadId,
  initialResumeSnapshot: { resumeState: { threadId, runId } },
  onChunk: (chunk) => console.log(JSON.stringify({ chunk })),
  onLoadingChange: (isLoading) => {
    if (isLoading) loading = true
    else if (loading) finish('done')
  },
})
client.attach()
