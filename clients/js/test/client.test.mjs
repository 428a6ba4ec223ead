// The reference client against a real `tally vote` (node --test). The
// address and the users' tokens come from the environment:
//   TALLY_URL=http://127.0.0.1:PORT TALLY_TOKENS='{"user": "token", ...}'
// tests/it/js_client.rs starts the API on the real stack and runs this file.
import { test } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";

import { Reaction, TallyClient, shown } from "../tally.mjs";

const base = process.env.TALLY_URL ?? "";
const tokens = JSON.parse(process.env.TALLY_TOKENS ?? "{}");

/** A client for `user`, through `url` (the API unless a proxy is given). */
function clientOf(user, url = base, extra = {}) {
  assert.ok(tokens[user], `no token for ${user}`);
  return new TallyClient({ baseUrl: url, token: () => tokens[user], baseDelayMs: 50, ...extra });
}

/** What the API says of one target, for `user`. */
async function served(user, target) {
  return (await clientOf(user).summary([target]))[target];
}

/** Waits until `reaction` has no click left to send. */
async function settled(reaction) {
  for (let i = 0; i < 200 && (reaction.sending || reaction.wanted !== undefined); i++) {
    await new Promise((r) => setTimeout(r, 25));
  }
  assert.equal(reaction.sending, false, "the clicks were sent");
}

test("shown moves the counts from the confirmed state to the wanted one", () => {
  const liked = { likes: 3, dislikes: 1, user_state: "like" };
  assert.deepEqual(shown(liked, "dislike"), { likes: 2, dislikes: 2, user_state: "dislike" });
  assert.deepEqual(shown(liked, "none"), { likes: 2, dislikes: 1, user_state: "none" });
  assert.deepEqual(shown(liked, "like"), liked);
});

test("a double click counts once, and what is drawn equals the API", async () => {
  const client = clientOf("js-double");
  const views = [];
  const first = await served("js-double", "video_js_double");
  const r = new Reaction(client, "video_js_double", "video", first, (v) => views.push(v));
  r.click("like");
  r.click("like");
  await settled(r);
  const truth = await served("js-double", "video_js_double");
  assert.deepEqual(truth, { likes: 1, dislikes: 0, user_state: "like" });
  assert.deepEqual(views.at(-1).counts, truth, "the last drawing is the API's answer");
  assert.equal(views[1].pending, true, "the click was drawn before the answer");
  assert.deepEqual(views[1].counts, truth, "and drawn right");
});

test("a response lost on the way back is retried with its key: counted once, the later click kept", async () => {
  // A proxy that passes requests on and, once, drops the answer to a vote:
  // the vote commits, the client never hears of it.
  let dropped = 0;
  const target = new URL(base);
  const proxy = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      const upstream = http.request(
        { host: target.hostname, port: target.port, path: req.url, method: req.method, headers: req.headers },
        (up) => {
          const body = [];
          up.on("data", (c) => body.push(c));
          up.on("end", () => {
            if (req.method === "POST" && dropped === 0) {
              dropped += 1;
              req.socket.destroy();
              return;
            }
            res.writeHead(up.statusCode ?? 502, up.headers);
            res.end(Buffer.concat(body));
          });
        },
      );
      upstream.end(Buffer.concat(chunks));
    });
  });
  await new Promise((r) => proxy.listen(0, "127.0.0.1", r));
  try {
    const url = `http://127.0.0.1:${proxy.address().port}`;
    const client = clientOf("js-lossy", url);
    const liked = await client.vote("video_js_lossy", "video", "like");
    assert.equal(dropped, 1, "the first answer was dropped");
    assert.deepEqual(liked, { target_id: "video_js_lossy", likes: 1, dislikes: 0, user_state: "like" });
    const disliked = await client.vote("video_js_lossy", "video", "dislike");
    assert.equal(disliked.user_state, "dislike");
    assert.deepEqual(await served("js-lossy", "video_js_lossy"), { likes: 0, dislikes: 1, user_state: "dislike" });
  } finally {
    proxy.close();
  }
});

test("two tabs of one user converge on the last click", async () => {
  const [tab1, tab2] = [clientOf("js-tabs"), clientOf("js-tabs")];
  const start = await served("js-tabs", "video_js_tabs");
  const views = [[], []];
  const r1 = new Reaction(tab1, "video_js_tabs", "video", start, (v) => views[0].push(v));
  const r2 = new Reaction(tab2, "video_js_tabs", "video", start, (v) => views[1].push(v));
  r1.click("like");
  await settled(r1);
  r2.click("dislike");
  await settled(r2);
  const truth = await served("js-tabs", "video_js_tabs");
  assert.deepEqual(truth, { likes: 0, dislikes: 1, user_state: "dislike" });
  // The first tab reads the page again, as it would on focus, and agrees.
  const again = await tab1.summary(["video_js_tabs", "video_js_tabs"]);
  assert.deepEqual(again.video_js_tabs, truth);
  assert.deepEqual(views[1].at(-1).counts, truth);
});

test("a 429 is waited out for its Retry-After, and every vote lands", async () => {
  let refused = 0;
  const counting = async (input, init) => {
    const res = await fetch(input, init);
    if (res.status === 429) refused += 1;
    return res;
  };
  const client = clientOf("js-eager", base, { fetch: counting, maxAttempts: 10 });
  // The API under test allows this user 2 votes a second, bursts of 3.
  const answers = [];
  for (let i = 0; i < 6; i++) {
    answers.push(await client.vote(`video_js_eager_${i}`, "video", "like"));
  }
  assert.ok(refused > 0, "the limit was met");
  assert.ok(answers.every((a) => a.likes === 1 && a.user_state === "like"));
  const page = await clientOf("js-eager").summary(answers.map((a) => a.target_id));
  assert.equal(Object.values(page).filter((c) => c.user_state === "like").length, 6);
});

test("a refused vote rolls the drawing back, with the reason", async () => {
  const client = clientOf("js-refused");
  const views = [];
  const start = { likes: 0, dislikes: 0, user_state: "none" };
  // A target id the API refuses (400): the click is drawn, then undone.
  const r = new Reaction(client, "bad id with spaces", "video", start, (v) => views.push(v));
  r.click("like");
  await settled(r);
  const last = views.at(-1);
  assert.deepEqual(last.counts, start);
  assert.ok(last.error && last.error.length > 0, "a message says why");
});

test("summary dedupes and batches a long page", async () => {
  const seen = [];
  const spying = async (input, init) => {
    seen.push(String(input));
    return fetch(input, init);
  };
  const client = clientOf("js-reader", base, { fetch: spying });
  const ids = Array.from({ length: 250 }, (_, i) => `video_js_page_${i % 150}`);
  const page = await client.summary(ids);
  assert.equal(Object.keys(page).length, 150);
  assert.equal(seen.length, 2, "150 distinct ids: two requests of at most 100");
});

test("counts read before a vote's answer are not drawn over it; counts read after are", async () => {
  const client = clientOf("js-refresh");
  const views = [];
  const target = "video_js_refresh";
  const r = new Reaction(client, target, "video", await served("js-refresh", target), (v) => views.push(v));
  const before = r.generation;
  const stale = await served("js-refresh", target);
  r.click("like");
  await settled(r);
  assert.equal(r.refresh(stale, before), false, "a read from before the answer is dropped");
  assert.equal(views.at(-1).counts.user_state, "like");
  const since = r.generation;
  const fresh = await served("js-refresh", target);
  assert.equal(r.refresh(fresh, since), true);
  assert.deepEqual(views.at(-1).counts, { likes: 1, dislikes: 0, user_state: "like" });
});
