-- wrk: pages of 21 ids nobody has reacted to, new on every page (random
-- among a billion), each from a random user of $WRK_TOKENS: every id is a
-- cache miss, the long tail a reader scrolls into. Used by benches/wrk/run.sh.
local tokens = {}
for line in io.lines(os.getenv("WRK_TOKENS")) do tokens[#tokens + 1] = line end
-- Seeded by the clock: the warm-up and the loop after it read other ids.
math.randomseed(os.time())
request = function()
  local ids = "n" .. math.random(1000000000)
  for _ = 1, 20 do ids = ids .. ",n" .. math.random(1000000000) end
  return wrk.format("GET", "/v1/votes/summary?target_ids=" .. ids,
    { ["Authorization"] = "Bearer " .. tokens[math.random(#tokens)] })
end
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "") .. "done.lua")
