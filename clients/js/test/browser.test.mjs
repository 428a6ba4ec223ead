// The demo page (`tally vote --demo`) and the reference client in a real
// headless Chromium (Debian's), driven over the DevTools protocol by
// playwright-core, against a real `tally vote` on the real stack:
//   TALLY_URL=http://127.0.0.1:PORT node --test test/browser.test.mjs
// tests/it/browser.rs starts the API (each user may vote twice a second,
// in bursts of 3) and runs this file. TALLY_SCREENSHOT=path saves the page
// after the last test; TALLY_CHROMIUM overrides /usr/bin/chromium.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { isDeepStrictEqual } from "node:util";

import { chromium } from "playwright-core";

const base = process.env.TALLY_URL ?? "";
/** @type {import("playwright-core").Browser} */
let browser;

before(async () => {
  assert.ok(base, "TALLY_URL names the API");
  browser = await chromium.launch({
    executablePath: process.env.TALLY_CHROMIUM ?? "/usr/bin/chromium",
    // As root, and with no network beyond loopback: no sandbox, and none
    // of Chromium's own calls home.
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
});

after(async () => {
  await browser?.close();
});

/** A token for `user`, from the demo's login, for reading the API directly. */
async function tokenOf(user) {
  const res = await fetch(`${base}/demo/login`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ user }),
  });
  assert.equal(res.status, 200);
  return (await res.json()).token;
}

/** What the API serves `user` for `ids`: counts and their own state. */
async function served(user, ids) {
  const res = await fetch(`${base}/v1/votes/summary?target_ids=${ids.join(",")}`, {
    headers: { Authorization: `Bearer ${await tokenOf(user)}` },
  });
  assert.equal(res.status, 200);
  return (await res.json()).items;
}

/** The demo page of `video` for `user`, in a tab of `context`, once drawn. */
async function open(context, user, video, poll = 0) {
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(e));
  await page.goto(`${base}/demo?user=${user}&video=${video}&poll=${poll}`);
  await page.waitForFunction(() => document.body.dataset.ready !== undefined);
  assert.equal(await page.evaluate(() => document.body.dataset.ready), "true", "the page started");
  page.errors = errors;
  return page;
}

const row = (page, id) => page.locator(`[data-target="${id}"]`);
const button = (page, id, action) => row(page, id).locator(`button[data-action="${action}"]`);

/** Waits until no button of the page has a click left to send. */
async function settled(page) {
  await page.waitForFunction(() => window.tallyDemo.settled(), null, { timeout: 30_000 });
}

/** What the page draws for each of its ids. */
async function drawn(page) {
  return page.evaluate(() =>
    Object.fromEntries(
      [...document.querySelectorAll("[data-target]")].map((el) => [
        el.dataset.target,
        {
          likes: Number(el.querySelector('[data-action="like"] .count').textContent),
          dislikes: Number(el.querySelector('[data-action="dislike"] .count').textContent),
          user_state: ["like", "dislike"].find((a) => el.querySelector(`[data-action="${a}"]`).getAttribute("aria-pressed") === "true") ?? "none",
        },
      ]),
    ),
  );
}

/**
 * The page draws, for every one of its 21 ids, what the API serves, within
 * 10 s. A polling page may have drawn a summary read between a vote's commit
 * and its cache step (the row already changed, the counts not yet); its next
 * poll draws the truth, so the two are compared until they agree.
 */
async function drawsWhatTheApiServes(page, user) {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const shown = await drawn(page);
    const ids = Object.keys(shown);
    assert.equal(ids.length, 21, "a video and 20 comments");
    const truth = await served(user, ids);
    if (isDeepStrictEqual(shown, truth)) break;
    if (Date.now() > deadline) assert.deepEqual(shown, truth, "the page still draws other counts than the API serves after 10 s");
    await page.waitForTimeout(100);
  }
  assert.deepEqual(page.errors, [], "no script error");
}

/** Votes the page sends, with their keys, and what came back. */
function watchVotes(page) {
  const seen = { requests: [], statuses: [], replayed: 0 };
  page.on("request", (r) => {
    if (r.method() === "POST" && r.url().endsWith("/v1/votes")) seen.requests.push(r.headers()["idempotency-key"]);
  });
  page.on("response", (r) => {
    if (r.request().method() === "POST" && r.url().endsWith("/v1/votes")) {
      seen.statuses.push(r.status());
      if (r.headers()["idempotent-replayed"] === "true") seen.replayed++;
    }
  });
  return seen;
}

test("a double click on like sends one vote and counts once", async () => {
  const context = await browser.newContext();
  const page = await open(context, "b-double", "bv-double");
  const votes = watchVotes(page);
  await button(page, "bv-double", "like").dblclick();
  await settled(page);
  assert.equal(votes.requests.length, 1, "one vote for a double click");
  assert.deepEqual((await served("b-double", ["bv-double"]))["bv-double"], { likes: 1, dislikes: 0, user_state: "like" });
  assert.equal(await button(page, "bv-double", "like").getAttribute("aria-pressed"), "true");
  await drawsWhatTheApiServes(page, "b-double");
  await context.close();
});

test("a vote whose answer is lost is retried with its key, counted once, and a click made meanwhile is kept", async () => {
  const context = await browser.newContext();
  const page = await open(context, "b-lossy", "bv-lossy");
  const votes = watchVotes(page);
  const id = "bv-lossy-c1";
  let committed;
  // The test proxy: the first vote reaches the API and commits, and its
  // answer is dropped on the way back; before the client hears of that,
  // the user changes their mind.
  await page.route("**/v1/votes", async (route) => {
    if (committed === undefined) {
      committed = await route.fetch();
      await button(page, id, "dislike").click();
      await route.abort("connectionreset");
    } else {
      await route.continue();
    }
  });
  await button(page, id, "like").click();
  await settled(page);
  assert.equal(committed.status(), 200, "the lost vote had committed");
  assert.equal((await committed.json()).likes, 1);
  const [lost, retry, later] = votes.requests;
  assert.equal(votes.requests.length, 3, `the lost like, its retry, the dislike: ${votes.requests}`);
  assert.equal(retry, lost, "the retry reuses the lost vote's key");
  assert.notEqual(later, lost, "the later click is a new action with a key of its own");
  assert.equal(votes.replayed, 1, "the retry was answered from the stored result");
  assert.deepEqual((await served("b-lossy", [id]))[id], { likes: 0, dislikes: 1, user_state: "dislike" }, "the later click won, and the like was counted once");
  await drawsWhatTheApiServes(page, "b-lossy");
  await context.close();
});

test("two tabs of one user converge on the last vote, in either tab", async () => {
  const context = await browser.newContext();
  const [a, b] = [await open(context, "b-tabs", "bv-tabs", 300), await open(context, "b-tabs", "bv-tabs", 300)];
  await button(a, "bv-tabs", "like").click();
  await settled(a);
  await b.waitForFunction(() => document.querySelector('[data-target="bv-tabs"]').dataset.state === "like", null, { timeout: 10_000 });
  await button(b, "bv-tabs", "dislike").click();
  await settled(b);
  await a.waitForFunction(() => document.querySelector('[data-target="bv-tabs"]').dataset.state === "dislike", null, { timeout: 10_000 });
  assert.deepEqual((await served("b-tabs", ["bv-tabs"]))["bv-tabs"], { likes: 0, dislikes: 1, user_state: "dislike" });
  for (const tab of [a, b]) await drawsWhatTheApiServes(tab, "b-tabs");
  await context.close();
});

test("clicks faster than the user's limit are refused with 429, waited out, and all land", async () => {
  const context = await browser.newContext();
  const page = await open(context, "b-eager", "bv-eager");
  const votes = watchVotes(page);
  const ids = Array.from({ length: 8 }, (_, i) => `bv-eager-c${i + 1}`);
  // All eight in one tick: clicked one by one, a slow machine can space
  // them out enough for the limit to refill, and then nothing meets it.
  await page.evaluate((ids) => {
    for (const id of ids) document.querySelector(`[data-target="${id}"] button[data-action="like"]`).click();
  }, ids);
  await settled(page);
  assert.ok(votes.statuses.includes(429), `some clicks met the limit: ${votes.statuses}`);
  const truth = await served("b-eager", ids);
  for (const id of ids) assert.deepEqual(truth[id], { likes: 1, dislikes: 0, user_state: "like" }, id);
  assert.equal(await page.locator(".error:not(:empty)").count(), 0, "no click was given up");
  await drawsWhatTheApiServes(page, "b-eager");
  await context.close();
});

test("three users on one page: every tab draws the counts the API serves", async () => {
  const clicks = {
    "b-ana": [["bv-shared", "like"], ["bv-shared-c1", "like"], ["bv-shared-c3", "dislike"]],
    "b-bo": [["bv-shared", "dislike"], ["bv-shared-c1", "like"], ["bv-shared-c2", "like"]],
    "b-chen": [["bv-shared", "like"], ["bv-shared-c2", "dislike"]],
  };
  const pages = {};
  for (const [user, list] of Object.entries(clicks)) {
    const page = await open(await browser.newContext({ viewport: { width: 820, height: 1100 } }), user, "bv-shared");
    for (const [id, action] of list) await button(page, id, action).click();
    pages[user] = page;
  }
  for (const page of Object.values(pages)) await settled(page);
  // Each tab's own votes are drawn from their answers; the others' arrive
  // with the next read of the counts.
  for (const [user, page] of Object.entries(pages)) {
    await page.evaluate(() => window.tallyDemo.refresh());
    await drawsWhatTheApiServes(page, user);
  }
  const truth = await served("b-ana", ["bv-shared", "bv-shared-c1", "bv-shared-c2"]);
  assert.deepEqual(
    [truth["bv-shared"].likes, truth["bv-shared"].dislikes, truth["bv-shared-c1"].likes, truth["bv-shared-c2"].likes],
    [2, 1, 2, 1],
    "each user's clicks counted once",
  );
  if (process.env.TALLY_SCREENSHOT) await pages["b-ana"].screenshot({ path: process.env.TALLY_SCREENSHOT, fullPage: true });
  for (const page of Object.values(pages)) await page.context().close();
});
