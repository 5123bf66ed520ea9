// Store and rendezvous (comm/store.h): HashStore semantics, the timeout message listing the
// ranks that never arrived, and c10d::TCPStore behind our interface (server + clients as
// threads of this process, on a free port).
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "core/error.h"
#include "comm/store.h"

using namespace dflash::comm;

namespace {
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

void all_ranks_rendezvous(Store& s0, std::vector<Store*> stores) {
  int world = static_cast<int>(stores.size());
  std::vector<std::vector<std::string>> got(world);
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r)
    th.emplace_back([&, r] { got[r] = rendezvous(*stores[r], "t", r, world, "host" + std::to_string(r), 10); });
  for (auto& t : th) t.join();
  (void)s0;
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(got[r].size(), static_cast<size_t>(world)) << "rank " << r;
    for (int q = 0; q < world; ++q) EXPECT_EQ(got[r][q], "host" + std::to_string(q));
  }
}
}  // namespace

TEST(HashStore, SetGetAddWait) {
  HashStore s;
  s.set_string("a", "1");
  EXPECT_EQ(s.get_string("a", 1), "1");
  EXPECT_EQ(s.add("n", 2), 2);
  EXPECT_EQ(s.add("n", 3), 5);
  EXPECT_TRUE(s.check({"a", "n"}));
  EXPECT_FALSE(s.check({"a", "b"}));
  std::thread t([&] { s.set_string("late", "x"); });
  s.wait({"late"}, 10);
  t.join();
  try {
    s.get("never", 0.05);
    FAIL() << "get of a missing key returned";
  } catch (const dflash::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos) << e.what();
  }
}

TEST(HashStore, RendezvousOfFour) {
  HashStore s;
  all_ranks_rendezvous(s, {&s, &s, &s, &s});
}

// Only ranks 0 and 2 of 4 arrive: rank 0's error lists ranks 1 and 3.
TEST(HashStore, RendezvousTimeoutListsMissingRanks) {
  HashStore s;
  std::thread r2([&] {
    try {
      rendezvous(s, "start", 2, 4, "h2", 0.5);
    } catch (const dflash::CommError&) {
    }
  });
  std::string msg;
  try {
    rendezvous(s, "start", 0, 4, "h0", 0.3);
  } catch (const dflash::CommError& e) {
    msg = e.what();
  }
  r2.join();
  EXPECT_NE(msg.find("ranks 1, 3 of 4 did not arrive"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'start'"), std::string::npos) << msg;
}

TEST(HashStore, RendezvousTimeoutOnNonZeroRankNamesRankZero) {
  HashStore s;
  std::string msg;
  try {
    rendezvous(s, "start", 1, 2, "h1", 0.1);
  } catch (const dflash::CommError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank 0 did not complete"), std::string::npos) << msg;
}

TEST(TcpStore, ServerAndClientsRendezvous) {
  int port = free_port();
  TcpStore server("127.0.0.1", port, true, 10, "dflash/a0/");
  TcpStore c1("127.0.0.1", port, false, 10, "dflash/a0/");
  TcpStore c2("127.0.0.1", port, false, 10, "dflash/a0/");
  c1.set_string("k", "v");
  EXPECT_EQ(server.get_string("k", 1), "v");
  EXPECT_EQ(c2.add("n", 4), 4);
  EXPECT_EQ(server.add("n", 1), 5);
  // prefixes separate attempts
  TcpStore other("127.0.0.1", port, false, 10, "dflash/a1/");
  EXPECT_FALSE(other.check({"k"}));
  all_ranks_rendezvous(server, {&server, &c1, &c2});
}

TEST(TcpStore, RendezvousTimeoutListsMissingRanks) {
  int port = free_port();
  TcpStore server("127.0.0.1", port, true, 10, "p/");
  std::string msg;
  try {
    rendezvous(server, "start", 0, 3, "h0", 0.3);
  } catch (const dflash::CommError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("ranks 1, 2 of 3 did not arrive"), std::string::npos) << msg;
}

TEST(TcpStore, ConnectFailureNamesAddress) {
  int port = free_port();  // nobody serves it
  try {
    TcpStore c("127.0.0.1", port, false, 0.5, "p/");
    FAIL() << "connected to nothing";
  } catch (const dflash::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
  }
}
