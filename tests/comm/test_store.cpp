// Store and rendezvous (comm/store.h): HashStore semantics, the timeout message listing the
// ranks that never arrived, and c10d::TCPStore behind our interface (server + clients as
// threads of this process, on a free port).
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
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

// Rank 2 of 4 never arrives: rank 0 names it at its deadline, and the ranks that did arrive
// learn rank 0's verdict through the store (they name rank 2 too, not rank 0, and end at rank
// 0's deadline instead of their own, which is 1.5 s later).
TEST(HashStore, RendezvousVerdictOfRankZeroReachesTheOthers) {
  HashStore s;
  std::vector<std::string> msg(4);
  std::vector<double> took(4, 0);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> th;
  for (int r : {0, 1, 3})
    th.emplace_back([&, r] {
      try {
        rendezvous(s, "start", r, 4, "h", 0.5);
      } catch (const dflash::CommError& e) {
        msg[r] = e.what();
      }
      took[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  for (auto& t : th) t.join();
  EXPECT_NE(msg[0].find("rank 2 of 4 did not arrive"), std::string::npos) << msg[0];
  for (int r : {1, 3}) {
    EXPECT_NE(msg[r].find("rank 2 of 4 did not arrive"), std::string::npos) << msg[r];
    EXPECT_NE(msg[r].find("reported by rank 0"), std::string::npos) << msg[r];
    EXPECT_LT(took[r], 1.5) << "rank " << r << " waited for its own deadline (0.5 + 1.5 s)";
  }
}

// Rank 0 never runs the rendezvous, the store still answers: a waiting rank says which ranks
// the store has no record of (rank 2), from the store itself.
TEST(HashStore, RendezvousWithoutRankZeroNamesWhoNeverCheckedIn) {
  HashStore s;
  std::string msg1;
  std::thread r3([&] {
    try {
      rendezvous(s, "start", 3, 4, "h3", 0.2);
    } catch (const dflash::CommError&) {
    }
  });
  try {
    rendezvous(s, "start", 1, 4, "h1", 0.2);
  } catch (const dflash::CommError& e) {
    msg1 = e.what();
  }
  r3.join();
  EXPECT_NE(msg1.find("rank 0 did not complete it"), std::string::npos) << msg1;
  EXPECT_NE(msg1.find("the store has no record of rank 2: it did not arrive"), std::string::npos) << msg1;
}

// The store host goes away in the middle of the rendezvous (no progress board in this process:
// nothing is known about rank 0): the waiting rank says the connection was lost and does not
// claim that rank 0 died, nor waits for its deadline.
TEST(TcpStore, RendezvousLostStoreHostIsReportedAsSuch) {
  int port = free_port();
  auto server = std::make_unique<TcpStore>("127.0.0.1", port, true, 10, "p/");
  TcpStore client("127.0.0.1", port, false, 10, "p/");
  std::string msg;
  auto t0 = std::chrono::steady_clock::now();
  std::thread r1([&] {
    try {
      rendezvous(client, "start", 1, 2, "h1", 5);
    } catch (const dflash::CommError& e) {
      msg = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  server.reset();
  r1.join();
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("lost the connection to the store"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("rank 0 (pid"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("is gone"), std::string::npos) << msg;
  EXPECT_LT(took, 4.0) << msg;
}
