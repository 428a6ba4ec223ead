-- wrk: votes of random users of $WRK_TOKENS on 10,000 videos (t0 to t9999,
-- as in benches/http.rs), a random action each, each with an Idempotency-Key
-- of its own. Used by run.sh and benches/http.rs.
local tokens = {}
for line in io.lines(os.getenv("WRK_TOKENS")) do tokens[#tokens + 1] = line end
-- A seed of its own each run: the same pairs again would meet the rows the
-- last run left and pay a refused round each.
math.randomseed(os.time())
local actions = { "like", "dislike", "none" }
local n = 0
request = function()
  n = n + 1
  local body = '{"target_id":"t' .. (math.random(10000) - 1) .. '","target_type":"video","action":"'
    .. actions[math.random(3)] .. '"}'
  return wrk.format("POST", "/v1/votes", {
    ["Authorization"] = "Bearer " .. tokens[math.random(#tokens)],
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = string.format("wrk-%d-%d-%d", os.time(), n, math.random(1e9)),
  }, body)
end
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "") .. "done.lua")
