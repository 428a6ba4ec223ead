-- wrk: pages of one video and its 20 comments (21 ids), each from a random
-- user of $WRK_TOKENS (one token a line). Used by benches/wrk/run.sh and benches/http.rs.
local tokens = {}
for line in io.lines(os.getenv("WRK_TOKENS")) do tokens[#tokens + 1] = line end
math.randomseed(7)
request = function()
  -- The ids of benches/http.rs's pages: t0 to t199 and their c<n>_0 to _19.
  local v = math.random(200) - 1
  local ids = "t" .. v
  for k = 0, 19 do ids = ids .. ",c" .. v .. "_" .. k end
  return wrk.format("GET", "/v1/votes/summary?target_ids=" .. ids,
    { ["Authorization"] = "Bearer " .. tokens[math.random(#tokens)] })
end
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "") .. "done.lua")
