// core/parse.h: the comma-separated integer lists of command lines (regenerate --stop-ids,
// target_tool --ids): values, and the one-line error naming the option and the bad part; an
// environment knob among fixed choices (env_choice).
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.h"
#include "core/parse.h"

using dflash::parse_int;
using dflash::parse_int_list;
using dflash::UserError;

namespace {
std::string error_of(const std::string& text, bool one = false) {
  try {
    if (one) parse_int(text, "--x");
    else parse_int_list(text, "--x");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Parse, IntLists) {
  EXPECT_EQ(parse_int_list("1,2,3", "--x"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(parse_int_list("-7,151645", "--x"), (std::vector<int64_t>{-7, 151645}));
  EXPECT_EQ(parse_int_list("", "--x"), std::vector<int64_t>{});
  EXPECT_EQ(parse_int_list("5,", "--x"), std::vector<int64_t>{5});  // a trailing comma ends the list
  EXPECT_EQ(parse_int("42", "--x"), 42);
}

TEST(Parse, BadTextNamesTheOptionAndThePart) {
  EXPECT_EQ(error_of("1,x,3"), "--x: 'x' is not an integer");
  EXPECT_EQ(error_of("2.5"), "--x: '2.5' is not an integer");
  EXPECT_EQ(error_of("1,,2"), "--x: '' is not an integer");
  EXPECT_EQ(error_of("99999999999999999999"), "--x: '99999999999999999999' is not an integer");
  EXPECT_EQ(error_of("1,2", true), "--x: '1,2' is not an integer");
  EXPECT_EQ(error_of("", true), "--x: '' is not an integer");
}

TEST(Parse, EnvChoice) {
  ::unsetenv("DFLASH_TEST_CHOICE");
  EXPECT_EQ(dflash::env_choice("DFLASH_TEST_CHOICE", "b", {"a", "b"}), "b");  // unset: the fallback
  ::setenv("DFLASH_TEST_CHOICE", "a", 1);
  EXPECT_EQ(dflash::env_choice("DFLASH_TEST_CHOICE", "b", {"a", "b"}), "a");
  ::setenv("DFLASH_TEST_CHOICE", "z", 1);
  try {
    dflash::env_choice("DFLASH_TEST_CHOICE", "a", {"a", "b", "c"});
    ADD_FAILURE() << "no error for a value outside the choices";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "DFLASH_TEST_CHOICE=z: expected a, b or c");
  }
  ::unsetenv("DFLASH_TEST_CHOICE");
}
